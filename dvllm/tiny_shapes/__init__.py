"""tiny-shapes: dvllm's own small text-to-image model, trained in the repo on generated shapes."""
