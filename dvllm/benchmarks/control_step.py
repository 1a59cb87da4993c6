"""A step with ControlNet rows against the same step without, on one device: what a request's control costs.

The model is a preset with dummy weights and so is its controlnet: a ControlNetModel with the preset UNet's own
architecture (diffusers' ControlNetModel config from the UNet's), random weights, saved to a temporary folder and
loaded at start like any `--controlnet`. The engine is stepped by hand with `--rows` requests of one size, first
none of them controlled, then the first `--controlled` of them each with one control (the others as they were):
after a warm-up step each, `--timed` steps of each batch are timed one by one (the device synchronized around
each), and the ratio of their medians is what the controlnet adds. The two batches run the same rows, so the
ratio is the controls' cost, which grows with the controlled rows (each controlnet runs on its own rows only).

    python -m dvllm.benchmarks.control_step --model sdxl --device cuda --dtype float16 --size 1024
    python -m dvllm.benchmarks.control_step --dry-run     # tiny-sd on the CPU, in seconds
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.benchmarks.clip_step import STATE_POOL_MB
from dvllm.logging_setup import quiet_libraries


def dummy_controlnet(model: str, dtype: torch.dtype, folder: str, seed: int = 0) -> str:
    """A random-weight ControlNetModel of the preset's UNet architecture, saved in `folder`."""
    from diffusers import ControlNetModel

    from dvllm.models.model_names import load_preset

    components = load_preset(model)["components"]
    takes = inspect.signature(ControlNetModel.__init__).parameters  # the UNet's config less its decoder's keys
    unet = {k: v for k, v in components["unet"].items() if k in takes}
    # the conditioning embedding downsamples the image to the latents' size: one level per halving of the VAE
    levels = len(components["vae"]["block_out_channels"])
    torch.manual_seed(seed)
    net = ControlNetModel.from_config({**unet, "conditioning_embedding_out_channels": (16, 32, 96, 256)[:levels]})
    with quiet_libraries():  # (diffusers' note on casting a whole model with to(): nothing here keeps float32)
        net.to(dtype).save_pretrained(folder)
    return folder


def time_batch(engine: DiffusionEngine, requests: list[tuple[str, SamplingParams]], timed: int,
               device: torch.device) -> list[float]:
    """Seconds of each of `timed` steps of the batch, after one warm-up step; the requests then aborted."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    seconds = []
    for step in range(1 + timed):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if engine.last_step.num_requests != len(requests):
            raise RuntimeError(f"step {step}: {engine.last_step.num_requests} of {len(requests)} requests ran")
        if step:
            seconds.append(time.perf_counter() - start)
    for i in range(len(requests)):
        engine.abort_request(f"r{i}")
    engine.step()
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as folder:
        net = dummy_controlnet(args.model, dtype, folder)
        engine = DiffusionEngine(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                                 controlnets={"c": net}, state_pool_mb=STATE_POOL_MB,
                                 max_batch_size=2 * args.rows, max_inference_steps=max(1000, args.timed + 2))
        try:
            device = engine.executor.worker.runner.adapter.device
            image = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
            common = dict(height=args.size, width=args.size, num_inference_steps=args.timed + 2, guidance_scale=5.0)
            plain = [(f"prompt {i}", SamplingParams(seed=i, **common)) for i in range(args.rows)]
            mixed = [(prompt, SamplingParams(**{**vars(params), "controls": [{"name": "c", "image": image}]})
                      if i < args.controlled else params) for i, (prompt, params) in enumerate(plain)]
            without = time_batch(engine, plain, args.timed, device)
            with_controls = time_batch(engine, mixed, args.timed, device)
        finally:
            engine.shutdown()
    result = {"model": args.model, "device": str(device), "dtype": args.dtype, "size": args.size, "rows": args.rows,
              "controlled": args.controlled, "step_s_without": without, "step_s_with": with_controls,
              "ratio": statistics.median(with_controls) / statistics.median(without)}
    print(f"{args.model} {args.size}x{args.size} on {device}: {args.rows} requests (CFG), a step "
          f"{statistics.median(without):.3f} s without controls, {statistics.median(with_controls):.3f} s with one on "
          f"{args.controlled} of them: {result['ratio']:.2f}x")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sdxl")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="requests in the batch (each with CFG: two rows)")
    parser.add_argument("--controlled", type=int, default=2, help="of them, those with a control")
    parser.add_argument("--timed", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="tiny-sd at 32x32 on the CPU")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.device, args.dtype, args.size = "tiny-sd", "cpu", "float32", 32
    if not 0 <= args.controlled <= args.rows:
        parser.error(f"--controlled must be in [0, --rows], got {args.controlled}")
    result = run(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
