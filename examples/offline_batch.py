"""Offline batch generation with the Python API: the job of `dvllm generate --prompts-file`.

    python examples/offline_batch.py                      # built-in prompts, built-in tiny-shapes model
    python examples/offline_batch.py --prompts-file prompts.txt --model path/to/sd --output-dir out/

Requests with different steps, guidance, samplers, seeds and image counts share one engine:
each engine step runs one denoiser forward over all of them, and no image depends on its
neighbours in the batch. The default model, tiny-shapes, draws simple coloured shapes.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from dvllm import DiffusionEngine, SamplingParams

PROMPTS = [  # what the built-in tiny-shapes model knows: colours, shapes, sizes, positions
    "a red circle on a white background",
    "a small blue square on the left",
    "a large green star",
    "a yellow triangle at the top",
    "an orange circle in the center",
]

# One mix of settings per prompt, in turn. None (the default) takes the model's own value.
MIXES = [
    SamplingParams(num_inference_steps=8, guidance_scale=7.5, sampler="ddim", seed=0),
    SamplingParams(num_inference_steps=4, guidance_scale=1.0, sampler="euler_a", seed=1, n=2),  # <= 1: no CFG
    SamplingParams(num_inference_steps=6, guidance_scale=5.0, sampler="dpmpp_2m_karras", seed=2,
                   negative_prompt="blurry"),
    SamplingParams(num_inference_steps=5, guidance_scale=3.0, sampler="euler"),  # no seed: drawn, then reported
]


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return PROMPTS
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def run_batch(engine: DiffusionEngine, prompts: list[str], output_dir: str) -> None:
    """The high-level call: every prompt to completion, outputs in input order."""
    params = [MIXES[i % len(MIXES)] for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    written = 0
    for i, (out, sp) in enumerate(zip(outputs, params)):
        if out.error is not None:  # a failed request fails alone; the rest of the batch is fine
            print(f"request {i} ({out.prompt!r}) failed: {out.error}")
            continue
        for k, image in enumerate(out.images):
            path = os.path.join(output_dir, f"{i:03d}-{k}.png")
            image.save(path)
            written += 1
        # The seed is always reported, so an image drawn with a random seed can be made again.
        print(f"{i:03d} seed={out.seed} steps={out.num_inference_steps} sampler={sp.sampler} "
              f"images={len(out.images)} latency={out.metrics.latency:.2f}s  {out.prompt!r}")
    print(f"{written} images in {elapsed:.2f} s ({written / elapsed:.2f} images/s)")


def run_step_loop(engine: DiffusionEngine, prompts: list[str], output_dir: str) -> None:
    """The low-level loop that generate() runs for you (and a server runs forever)."""
    for i, prompt in enumerate(prompts):
        # Different step counts: short requests finish and leave while long ones keep going.
        engine.add_request(f"loop-{i}", prompt, SamplingParams(num_inference_steps=2 + 2 * i, seed=100 + i))
    while engine.has_unfinished_requests():
        for out in engine.step():  # one output per request that took a step (or ended) this iteration
            if not out.finished:
                print(f"{out.request_id}: step {out.num_steps_done} of {out.num_inference_steps}")
            elif out.error is not None:
                print(f"{out.request_id}: failed: {out.error}")
            else:
                path = os.path.join(output_dir, f"{out.request_id}.png")
                out.images[0].save(path)
                print(f"{out.request_id}: done after {out.num_steps_done} steps (seed {out.seed}) -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-file", help="One prompt per line (default: a few built-in prompts).")
    parser.add_argument("--model", default=None, help="Diffusers folder, Hub id or preset (default: tiny-shapes).")
    parser.add_argument("--device", default="auto")
    # A temp folder by default, so a run from the repository leaves nothing in it.
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "dvllm-offline-batch"))
    args = parser.parse_args()

    os.makedirs(args.output_dir, exist_ok=True)
    prompts = read_prompts(args.prompts_file)
    engine = DiffusionEngine(model=args.model, device=args.device, max_batch_size=16)
    print(f"model {engine.model_info.name}: default {engine.model_info.defaults.width}x"
          f"{engine.model_info.defaults.height}, {engine.model_info.defaults.steps} steps")
    run_batch(engine, prompts, args.output_dir)
    run_step_loop(engine, prompts[:3], args.output_dir)
    print(f"images are in {args.output_dir}")


if __name__ == "__main__":
    main()
