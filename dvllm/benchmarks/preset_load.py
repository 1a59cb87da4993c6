"""Each family's preset loaded as users serve it: its weights' memory on the device, the requests the state
pool then holds, and one denoising step's time alone, in the family's dtype and quantized.

    python -m dvllm.benchmarks.preset_load --output-json presets.json   # on a GPU (benchmarks/gpu/run_suite.sh)
    python -m dvllm.benchmarks.preset_load --dry-run                    # tiny presets on the CPU, in seconds

Sizes are each model's default (64x64 in the dry run). A step's time is taken as the difference of two requests of 2 and 6 steps, divided by 4: what encoding,
decoding and admission cost falls out. Weights are random (load_format dummy): their memory and the step's
time are those of the real checkpoints; the images are not.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from dvllm import DiffusionEngine, SamplingParams


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    quantization: str | None = None
    encoder_device: str | None = None

    @property
    def label(self) -> str:
        extras = [x for x in (self.quantization, self.encoder_device and f"encoders on {self.encoder_device}") if x]
        return f"{self.model} {self.dtype}" + (f" ({', '.join(extras)})" if extras else "")


GPU_CASES = [
    Case("sd15", "float16"), Case("sdxl", "float16"), Case("sd3-medium", "bfloat16"), Case("flux-dev", "bfloat16"),
    Case("z-image-turbo", "bfloat16"), Case("qwen-image", "bfloat16"),
    Case("flux-dev", "bfloat16", "torchao:int8wo"), Case("flux-dev", "bfloat16", "torchao:float8wo", "cpu"),
]
DRY_CASES = [Case("tiny-sd", "float32"), Case("flux-cpu", "float32"), Case("flux-cpu", "float32", "torchao:int8wo"),
             Case("flux-cpu", "float32", None, "cpu")]


def weight_bytes(engine: DiffusionEngine, device: torch.device) -> int:
    """Bytes of every model's parameters and buffers that sit on `device` (quantized tensors at their own size)."""
    pipeline = engine.executor.worker.runner.adapter.pipeline
    total = 0
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in [*component.parameters(), *component.buffers()]:
                if tensor.device.type == device.type:
                    total += _nbytes(tensor)
    return total


def _nbytes(tensor: torch.Tensor) -> int:
    """A tensor's own bytes; a quantized tensor subclass (torchao, GGUF) counts its inner tensors'."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = inner()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def step_seconds(engine: DiffusionEngine, repeats: int, height: int, width: int) -> float:
    """One step's time at a size, one request alone (the best of `repeats`)."""
    def run(steps: int) -> float:
        params = SamplingParams(num_inference_steps=steps, seed=0, height=height, width=width, output_type="latent")
        start = time.perf_counter()
        out = engine.generate(["a photo of a lighthouse at dusk"], [params], use_tqdm=False)[0]
        if out.error is not None:
            raise RuntimeError(out.error)
        return time.perf_counter() - start

    run(2)  # warm-up: kernels, allocator
    return min((run(6) - run(2)) / 4 for _ in range(repeats))


def measure(case: Case, device: str, repeats: int, size: tuple[int, int] | None = None) -> dict:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = DiffusionEngine(model=case.model, load_format="dummy", device=device, dtype=case.dtype,
                             quantization=case.quantization, encoder_device=case.encoder_device)
    load_s = time.perf_counter() - start
    info = engine.model_info
    height, width = size or (info.defaults.height, info.defaults.width)
    blocks, _ = engine.executor.pool_info(0)
    result = {
        "case": case.label, "model": case.model, "dtype": case.dtype, "quantization": case.quantization,
        "encoder_device": case.encoder_device, "load_s": round(load_s, 1),
        "weights_gib": round(weight_bytes(engine, torch.device(device)) / 2**30, 3),
        "pool_blocks": blocks, "size": f"{width}x{height}",
        "step_s": round(step_seconds(engine, repeats, height, width), 4),
    }
    if device == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del engine
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on the CPU, to check the script")
    parser.add_argument("--only", default=None, help="comma-separated preset names to run (default: all)")
    parser.add_argument("--repeats", type=int, default=2, help="step-time measurements per case (best kept)")
    parser.add_argument("--output-json", default="preset_load.json")
    args = parser.parse_args(argv)
    cases, device = (DRY_CASES, "cpu") if args.dry_run else (GPU_CASES, "cuda")
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.model for c in cases}
        if unknown:
            raise SystemExit(f"--only: no case for {sorted(unknown)}; cases: {sorted({c.model for c in cases})}")
        cases = [c for c in cases if c.model in wanted]
    results = []
    for case in cases:
        try:
            results.append(measure(case, device, args.repeats, (64, 64) if args.dry_run else None))
        except Exception as e:  # one case that does not fit or load must not hide the others' figures
            results.append({"case": case.label, "error": f"{type(e).__name__}: {e}"})
        r = results[-1]
        print(r["case"], "->", r.get("error") or
              f"weights {r['weights_gib']:.3f} GiB, pool {r['pool_blocks']} blocks, step {r['step_s'] * 1000:.1f} ms "
              f"at {r['size']}, load {r['load_s']} s" + (f", peak {r['peak_gib']} GiB" if "peak_gib" in r else ""),
              flush=True)
        with open(args.output_json, "w") as f:  # after each case: a suite stopped early keeps what was measured
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "results": results},
                      f, indent=2)


if __name__ == "__main__":
    main()
