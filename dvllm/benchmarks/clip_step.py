"""One denoising step of a model's default request, timed on one device, and the arithmetic to the whole request.

The engine is stepped by hand with one request at the model's defaults (for the mlperf preset: MLPerf Inference
v6.0's Wan2.2 clip, 720x1280, 81 frames, 20 steps, CFG at 4.0 then 3.0): its first steps are a warm-up (the
encode, the kernels' first runs), the next ones are timed one by one, the device synchronized around each, and the
request is then aborted, so a 20-step clip costs only the steps timed. With --decode the VAE's decode of the
request's latents is timed too (after a warm-up decode of its first latent frames). The whole request is then
arithmetic, not a measurement: steps x the mean step time, plus the decode when timed.

    python -m dvllm.benchmarks.clip_step --model wan2.2-t2v-a14b-mlperf --device cuda --dtype bfloat16 --decode
    python -m dvllm.benchmarks.clip_step --dry-run     # wan-cpu at 32x32, 5 frames, on the CPU, in seconds
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from dvllm import DiffusionEngine, SamplingParams

# NVIDIA's MLPerf Inference v6.0 Wan2.2-T2V-A14B result, as published with the round (storagereview.com's copy of
# NVIDIA's table, 2026-04-01): another GPU generation, its own software and precision; for scale only
MLPERF_WAN22 = {"who": "MLPerf Inference v6.0, NVIDIA Blackwell Ultra (SingleStream)", "seconds_a_video": 21.0}
STATE_POOL_MB = 2048  # a pool sized by hand: no start-up memory profile (a forward of the worst step) to wait for


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(engine: DiffusionEngine, params: SamplingParams, steps: int, warmup: int, timed: int) -> list[float]:
    """Seconds of each of `timed` engine steps of one request of `steps` steps, after `warmup` steps; the request
    then aborted."""
    if warmup < 1 or timed < 1:
        raise ValueError(f"--warmup and --timed must be at least 1, got {warmup} and {timed}")
    if warmup + timed > steps:
        raise ValueError(f"--warmup {warmup} and --timed {timed} are more steps than the request's {steps}")
    device = engine.executor.worker.runner.adapter.device
    engine.add_request("clip", "a lighthouse on a cliff at dusk, waves below", params)
    seconds = []
    for i in range(warmup + timed):
        _sync(device)
        start = time.perf_counter()
        for out in engine.step():
            if out.request_id == "clip" and out.error is not None:
                raise RuntimeError(out.error)
        _sync(device)
        if engine.last_step.num_requests != 1:  # alone, the request steps in every iteration from its first
            raise RuntimeError(f"engine step {i + 1} ran no denoising step of the request ({engine.last_step})")
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    engine.abort_request("clip")
    engine.step()  # takes the abort's output
    return seconds


def time_decode(engine: DiffusionEngine, height: int, width: int, frames: int) -> float:
    """Seconds of the adapter's VAE decode of one request's latents (random; a decode's cost is its shapes'),
    after a warm-up decode of its first latent frames."""
    adapter = engine.executor.worker.runner.adapter
    shape = adapter.info.latents.shape(height, width, frames)
    latents = torch.randn((1, *shape), device=adapter.device, dtype=adapter.state_dtype)
    warm_frames = min(frames, 1 + 4 * adapter.info.latents.temporal_scale)
    with torch.inference_mode():  # as the worker decodes: no autograd state kept for 81 frames
        adapter.decode(latents[:, :, :adapter.info.latents.shape(height, width, warm_frames)[1]],
                       (height, width, warm_frames))
        _sync(adapter.device)
        start = time.perf_counter()
        adapter.decode(latents, (height, width, frames))
        _sync(adapter.device)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    engine = DiffusionEngine(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                             state_pool_mb=STATE_POOL_MB, max_batch_size=2, max_decode_batch=1,
                             vae_tiling=args.vae_tiling, enable_prompt_cache=False)
    load_s = time.perf_counter() - start
    try:
        info = engine.model_info
        height, width = args.size or (info.defaults.height, info.defaults.width)
        asked = SamplingParams(height=height, width=width, num_frames=args.frames, seed=0, output_type="latent")
        params = asked.resolve(info, engine.config)  # what the engine will run: the model's defaults filled in
        seconds = time_steps(engine, asked, params.num_inference_steps, args.warmup, args.timed)
        decode_s = time_decode(engine, height, width, params.num_frames) if args.decode else None
    finally:
        engine.shutdown()
    step_s = sum(seconds) / len(seconds)
    clip_s = params.num_inference_steps * step_s + (decode_s or 0.0)
    return {
        "kind": "measured: the steps (and the decode); the whole request: arithmetic, not measured",
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "size": f"{height}x{width}", "frames": params.num_frames,
        "steps": params.num_inference_steps, "guidance_scale": params.guidance_scale,
        "guidance_scale_2": params.guidance_scale_2, "cfg_rows": 2 if info.guidance.uses_cfg(params.guidance_scale)
        else 1, "load_s": round(load_s, 1), "warmup_steps": args.warmup, "step_s_each": [round(s, 4) for s in seconds],
        "step_s": round(step_s, 4), "decode_s": None if decode_s is None else round(decode_s, 3),
        "request_s_arithmetic": round(clip_s, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "published": MLPERF_WAN22,
    }


def report(result: dict[str, Any]) -> str:
    guidance = f"{result['guidance_scale']}" + ("" if result["guidance_scale_2"] is None
                                                else f" / {result['guidance_scale_2']}")
    decode = "not timed" if result["decode_s"] is None else f"{result['decode_s']:.2f} s"
    each = ", ".join(f"{s:.3f}" for s in result["step_s_each"])
    plus = "" if result["decode_s"] is None else f" + the decode {result['decode_s']:.2f} s"
    lines = [
        f"{result['model']} on {result['device']} ({result['dtype']}, dummy weights, loaded in {result['load_s']} s): "
        f"{result['size']}, {result['frames']} frames, {result['cfg_rows']} rows a step (guidance {guidance})",
        f"  measured: one denoising step {result['step_s']:.3f} s (mean of {len(result['step_s_each'])} after "
        f"{result['warmup_steps']} warm-up: {each} s); the decode {decode}"
        + (f"; peak {result['peak_gib']} GiB" if result["peak_gib"] is not None else ""),
        f"  arithmetic, not measured: {result['steps']} steps x {result['step_s']:.3f} s{plus} = "
        f"{result['request_s_arithmetic']:.1f} s a request on this one device",
        f"  published, for scale: {result['published']['who']}: {result['published']['seconds_a_video']:.0f} s a video",
    ]
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int]:
    height, sep, width = text.partition("x")
    if not (sep and height.isdigit() and width.isdigit() and int(height) > 0 and int(width) > 0):
        raise argparse.ArgumentTypeError(f"--size must be HEIGHTxWIDTH in pixels, e.g. 720x1280, got {text!r}")
    return int(height), int(width)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wan2.2-t2v-a14b-mlperf")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", type=_size, default=None, help="HEIGHTxWIDTH (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="a video's frames (default: the model's)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the timed ones (default 1)")
    parser.add_argument("--timed", type=int, default=2, help="steps timed (default 2)")
    parser.add_argument("--decode", action="store_true", help="also time the VAE's decode of the request")
    parser.add_argument("--vae-tiling", action="store_true", help="decode in tiles (as the memory estimate does)")
    parser.add_argument("--dry-run", action="store_true", help="wan-cpu at 32x32, 5 frames, on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.device, args.dtype = "wan-cpu", "cpu", "float32"
        args.size, args.frames = args.size or (32, 32), args.frames or 5
    result = run(args)
    print(report(result), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
