"""Talk to a running `dvllm serve` with the stock openai client: one plain request, one streamed.

    dvllm serve &                      # the built-in tiny-shapes on 127.0.0.1:8000
    python examples/api_client.py --out-dir out/

Writes out/plain-<seed>-<k>.png, and out/stream-partial-<i>.png then out/stream-final.png.
dvllm's own fields (seed, num_inference_steps, guidance_scale, negative_prompt, sampler, priority)
go in `extra_body`; every image's seed comes back beside it.
"""
from __future__ import annotations

import argparse
import base64
import os

import openai


def save(b64: str, path: str) -> None:
    with open(path, "wb") as f:
        f.write(base64.b64decode(b64))
    print(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("DVLLM_API_KEY", "none"),
                        help="The server's --api-key (default: $DVLLM_API_KEY; any string if the server has none).")
    parser.add_argument("--prompt", default="a red circle on a white background")
    parser.add_argument("--size", default="auto", help="WxH, or auto for the model's default.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", type=int, default=2, help="Images in the plain request.")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    extra = {"seed": args.seed, "num_inference_steps": args.steps}

    result = client.images.generate(model=model, prompt=args.prompt, size=args.size, n=args.n, extra_body=extra)
    for k, image in enumerate(result.data):
        save(image.b64_json, os.path.join(args.out_dir, f"plain-{image.model_extra['seed']}-{k}.png"))

    stream = client.images.generate(model=model, prompt=args.prompt, size=args.size, stream=True, partial_images=2,
                                    extra_body=extra)
    for event in stream:
        if event.type == "image_generation.partial_image":
            save(event.b64_json, os.path.join(args.out_dir, f"stream-partial-{event.partial_image_index}.png"))
        elif event.type == "image_generation.completed":
            save(event.b64_json, os.path.join(args.out_dir, "stream-final.png"))


if __name__ == "__main__":
    main()
