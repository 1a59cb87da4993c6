"""GPU memory a model needs under dvllm, computed without a GPU: weights, a step's activations, the state pool.

The model is built on the meta device (no weights) and its parts counted at the dtype dvllm loads them in
(a quantized denoiser's Linear weights at the backend's layout, quant_bytes.py). Then the worker's own memory
profile (worker/memory_profile.py: text encoders on a full admission batch, the denoiser on max_batch_size
rows, the VAE on max_decode_batch images) runs on fake tensors (fake_memory.py) instead of on a GPU: each
figure is the peak of a fake run's live tensors, an estimate, not a measurement. The pool is then sized as
the engine sizes it: gpu_memory_utilization of the card, less the weights, an assumed CUDA context and the
worst step the engine's limits allow (max_batch_size rows at the largest size max_image_pixels allows).

    python -m dvllm.sizing.memory_estimate --model black-forest-labs/FLUX.1-dev
    python -m dvllm.sizing.memory_estimate --model flux-dev --quantization torchao:int8wo \\
        --encoder-device cpu --max-image-pixels 1048576 --output-json flux.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from typing import Any

import torch

from dvllm.sizing.fake_memory import (
    PeakTracker,
    TrackedMemory,
    fake_session,
    quiet_libraries,
    tensor_bytes,
    to_fake,
)
from dvllm.sizing.quant_bytes import parse_spec, quantized_bytes
from dvllm.config import EngineConfig
from dvllm.engine.configs import EngineConfigs
from dvllm.engine.input_processor import InputProcessor
from dvllm.models.base import ModelAdapter
from dvllm.models.loader import DTYPES, _apply_defaults, _default_layers, dummy_components, resolve_dtype, resolve_model
from dvllm.models.quantization import components_of
from dvllm.models.registry import adapter_for
from dvllm.sampling_params import SamplingParams
from dvllm.worker.memory_profile import (
    choose_decode_stage,
    decode_queue_bytes,
    encode_ahead_bytes,
    largest_size,
    step_cache_bytes,
    step_peaks,
    worst_transient,
)
from dvllm.worker.memory_profile import (
    worst_size as worst_size_of,
)
from dvllm.worker.state_pool import choose_block_numel

GIB = 2**30
CARDS_GIB = (80, 24)  # an H100 80GB; a 24 GB card (RTX 4090, L4, A10)
CUDA_CONTEXT_GIB = 0.5  # assumed: the CUDA context and library handles, which memory_profile sees as used memory
DEFAULTS = EngineConfig()
# Hub ids whose architecture a preset builds (their configs, here without a download; the Hub's gated repos too)
HUB_PRESETS = {"stabilityai/stable-diffusion-xl-base-1.0": "sdxl", "black-forest-labs/flux.1-dev": "flux-dev",
               "qwen/qwen-image": "qwen-image", "tongyi-mai/z-image-turbo": "z-image-turbo",
               "wan-ai/wan2.1-t2v-1.3b-diffusers": "wan2.1-t2v-1.3b",
               "wan-ai/wan2.1-t2v-14b-diffusers": "wan2.1-t2v-14b"}


@dataclasses.dataclass
class Estimate:
    model: str
    family: str
    dtype: str
    quantization: str | None
    encoder_device: str
    weights: dict[str, int]       # component -> bytes on the GPU
    host_weights: dict[str, int]  # text encoders on the CPU (encoder_device)
    size: tuple[int, int]         # (height, width) of `step` and `request_bytes`: the model's default size
    rows: int                     # max_batch_size
    decode_batch: int             # max_decode_batch
    step: dict[str, int]          # encode, denoise (the forward alone), decode peaks at `size`
    worst_size: tuple[int, ...]  # (height, width), and a video model's frames
    worst: dict[str, int]         # the worst step the engine reserves (denoise with the step cache's extra)
    attention: dict[str, dict[str, int]]  # per kind of work, the attention kernels the fake runs took
    request_bytes: int            # the pool a default request at `size` takes, no prompt shared
    request_rows: int
    context: int
    utilization: float
    vae_tiling: bool
    # its VAE beside the loop's encode or denoise, and its queue of latents: as asked (None: auto, per card)
    decode_stage: bool | None = None
    decode_queue: int = 0         # bytes: the latents the decode stage may hold
    decode_workers: int = 0       # decode processes off this GPU: the stage's VAE is not beside the loop's
    encode_stage: bool = False    # its text encoders beside the loop's work, and the texts it holds ready
    encode_ahead: int = 0         # bytes: the texts' conditions and starts it may hold ready
    encode_workers: int = 0       # encode processes off this GPU: the text encoders are not on it at all
    cards: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    step_frames: int = 0          # a video model's frames in `step` (its default; 0 for an image model)

    @property
    def gpu_weights(self) -> int:
        return sum(self.weights.values())

    def reserved_for(self, decode_stage: bool) -> int:
        """The worst step's transient memory, as memory_profile.gpu_pool_bytes reserves it."""
        beside = decode_stage and not self.decode_workers
        return (worst_transient(self.worst, beside, self.encode_stage) + self.encode_ahead
                + (self.decode_queue if decode_stage else 0))

    def needed_for(self, decode_stage: bool) -> int:
        """What start-up takes before the pool gets a byte: weights, context and the worst step."""
        return self.gpu_weights + self.context + self.reserved_for(decode_stage)

    @property
    def reserved(self) -> int:
        """As asked; auto's figure without the stage (each card says whether auto turns it on)."""
        return self.reserved_for(self.decode_stage is True)

    @property
    def needed(self) -> int:
        return self.needed_for(self.decode_stage is True)


def parse_size(text: str) -> tuple[int, int]:
    height, sep, width = text.partition("x")
    if not (sep and height.isdigit() and width.isdigit() and int(height) > 0 and int(width) > 0):
        raise ValueError(f"size must be HEIGHTxWIDTH in pixels, e.g. 1024x1024, got {text!r}")
    return int(height), int(width)


def estimate(model: str, dtype: str = "auto", encoder_device: str | None = None, quantization: str | None = None,
             max_batch_size: int = DEFAULTS.max_batch_size, size: tuple[int, int] | None = None,
             max_image_pixels: int | None = None, max_decode_batch: int = DEFAULTS.max_decode_batch,
             gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization, vae_dtype: str = "auto",
             vae_tiling: bool = False, cards_gib: tuple[float, ...] = CARDS_GIB,
             context_gib: float = CUDA_CONTEXT_GIB, decode_stage: bool | None = DEFAULTS.decode_stage,
             max_decode_queue: int = DEFAULTS.max_decode_queue, encode_stage: bool = DEFAULTS.encode_stage,
             max_encode_ahead: int = DEFAULTS.max_encode_ahead, decode_workers: int = 0,
             encode_workers: int = 0, max_num_frames: int = DEFAULTS.max_num_frames) -> Estimate:
    """The estimate for `model` served on one GPU with these engine settings; ValueError for bad ones."""
    if dtype not in ("auto", *DTYPES) or vae_dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype and vae_dtype must be auto or one of {list(DTYPES)}, got {dtype!r}, {vae_dtype!r}")
    if encoder_device not in (None, "cpu"):
        raise ValueError(f"encoder_device must be cpu or None (the GPU), got {encoder_device!r}")
    if size is not None and not (len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        raise ValueError(f"size must be (height, width) in pixels, got {size!r}")
    if not cards_gib or not all(c > 0 for c in cards_gib) or context_gib < 0:
        raise ValueError(f"cards must be positive GiB and the context >= 0, got {cards_gib!r}, {context_gib!r}")
    if encode_workers:  # they encode for the stage, which runs for them
        encode_stage = True
    engine = {"max_batch_size": max_batch_size, "max_decode_batch": max_decode_batch,
              "gpu_memory_utilization": gpu_memory_utilization, "max_image_pixels": max_image_pixels,
              "decode_stage": decode_stage, "max_decode_queue": max_decode_queue, "encode_stage": encode_stage,
              "max_encode_ahead": max_encode_ahead, "decode_workers": decode_workers, "encode_workers": encode_workers,
              "max_num_frames": max_num_frames}
    EngineConfigs.of(EngineConfig(**engine))  # the engine's own checks of these values (and their owners')
    if decode_workers:  # the stage runs for them, whatever auto would choose
        decode_stage = True
    spec = parse_spec(quantization) if quantization else None
    with quiet_libraries():
        adapter, source, modules = _build(model, dtype, vae_dtype, vae_tiling)
        quantized = components_of(spec, source.model_index) if spec else {}
        weights, host = {}, {}
        for name, module in modules.items():
            nbytes = quantized_bytes(module, spec) if name in quantized else tensor_bytes(module)
            off_gpu = (encoder_device or encode_workers) and name.startswith("text_encoder")
            (host if off_gpu else weights)[name] = nbytes
        with fake_session() as mode:
            for module in modules.values():
                to_fake(module)
            with PeakTracker(mode):  # the model's info encodes the empty prompt once
                _apply_defaults(adapter, source, _default_layers(source, None))
            info = adapter.info
            size = size or (info.defaults.height, info.defaults.width)
            memory = TrackedMemory(mode)
            step, worst_size, worst = _steps(adapter, engine, size, memory)
        if encoder_device:  # the encoders run on the CPU: nothing of theirs on the GPU
            step["encode"] = worst["encode"] = 0
        request, block_bytes = _request(EngineConfig(**engine), adapter, *size)
    result = Estimate(
        model=model, family=info.family, dtype=str(adapter.dtype).removeprefix("torch."),
        quantization=str(spec) if spec else None, weights=weights,
        encoder_device="encode workers" if encode_workers else encoder_device or "gpu",
        host_weights=host, size=size, rows=max_batch_size, decode_batch=max_decode_batch, step=step,
        worst_size=worst_size, worst=worst, attention={k: dict(v) for k, v in memory.attention.items() if v},
        request_bytes=request.max_blocks * block_bytes, request_rows=request.rows, context=int(context_gib * GIB),
        utilization=gpu_memory_utilization, vae_tiling=vae_tiling, decode_stage=decode_stage,
        decode_queue=decode_queue_bytes(adapter, EngineConfig(**engine), decode_stage is not False),
        decode_workers=decode_workers, encode_workers=encode_workers,
        encode_stage=encode_stage, encode_ahead=encode_ahead_bytes(adapter, EngineConfig(**engine)),
        step_frames=(largest_size(info, size[0] * size[1]) + (0,))[2])
    for card in cards_gib:  # as memory_profile.gpu_pool_bytes: the share of the card, less all that is used
        def pool_bytes(stage: bool, card: float = card) -> int:
            return int(card * GIB * gpu_memory_utilization) - result.needed_for(stage)

        stage = choose_decode_stage(decode_stage, pool_bytes)
        pool = pool_bytes(stage)
        result.cards[f"{card:g}"] = {"pool_bytes": max(pool, 0), "short_bytes": max(-pool, 0),
                                     "requests": max(pool, 0) // block_bytes // request.max_blocks,
                                     "decode_stage": stage}
    return result


def _steps(adapter: ModelAdapter, engine: dict[str, Any], size: tuple[int, int],
           memory: TrackedMemory) -> tuple[dict[str, int], tuple[int, int], dict[str, int]]:
    """memory_profile's step peaks at the request size (the largest square of its area, as memory_profile runs
    them; the denoiser's forward alone), and the worst step the engine's limits allow (with what a step cache
    holds more, as start-up reserves it)."""
    info, height, width = adapter.info, *size
    step_size = largest_size(info, height * width)
    # a video model's step at its default frames (its worst at max_num_frames, below)
    frames = {"max_num_frames": step_size[2]} if len(step_size) == 3 else {}
    step = step_peaks(adapter, EngineConfig(**(engine | {"max_image_pixels": height * width} | frames)), memory)
    config = EngineConfig(**engine)
    worst_size = worst_size_of(info, config)  # as start-up reserves it: a video model at max_num_frames
    worst = dict(step) if worst_size == step_size else step_peaks(adapter, config, memory)
    step["denoise"] -= step_cache_bytes(info, engine["max_batch_size"], step_size, adapter.dtype)
    return step, worst_size, worst


def _build(model: str, dtype: str, vae_dtype: str, vae_tiling: bool) -> tuple[ModelAdapter, Any, dict[str, Any]]:
    """The model's adapter around meta-device components, cast as load_adapter casts them (dtype "auto" as on a
    GPU), with the adapter's own choices (SDXL's float32 VAE), vae_dtype and vae_tiling applied; its source and
    modules."""
    source = resolve_model(HUB_PRESETS.get(model.lower(), model))
    source.name = model  # a Hub id's known defaults (model_defaults.py) are found by its name
    adapter_cls = adapter_for(source.pipeline_class)
    torch_dtype = resolve_dtype(dtype, torch.device("cuda"), adapter_cls)
    adapter_cls.before_loading()
    components = dummy_components(source, adapter_cls, 0, meta=True)
    for value in components.values():
        if isinstance(value, torch.nn.Module):
            value.to(torch_dtype)
    pipeline = getattr(importlib.import_module("diffusers"), source.pipeline_class)(**components)
    if vae_tiling:
        pipeline.vae.enable_tiling()
    adapter = adapter_cls(pipeline, model, torch.device("cpu"), torch_dtype)
    if vae_dtype != "auto":
        adapter.place_vae(DTYPES[vae_dtype])
    modules = {k: v for k, v in pipeline.components.items() if isinstance(v, torch.nn.Module)}
    return adapter, source, modules


class _Admission(InputProcessor):
    """The engine's input processor without its start-up survey of every diffusers sampler (3 s; it serves only
    the messages that refuse a sampler)."""

    def _probe_samplers(self) -> list[str]:
        return []


def _request(config: EngineConfig, adapter: ModelAdapter, height: int, width: int) -> tuple[Any, int]:
    """A default request at this size as the engine admits it (its blocks), and the pool's bytes per block."""
    info = adapter.info
    block_numel = choose_block_numel(info)
    processor = _Admission(config, info, block_numel, pool_blocks=2**62)
    request = processor.process("estimate", "a prompt", SamplingParams(height=height, width=width))
    return request, block_numel * torch.empty((), dtype=adapter.dtype).element_size()


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def _parts(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())


def _encoders_at(e: Estimate) -> str:
    if e.encode_workers:
        return f"text encoders in {e.encode_workers} encode process(es) off this GPU"
    return "encoders beside the loop's"


def render(e: Estimate) -> str:
    """A short table for people."""
    (h, w), (wh, ww) = e.size[:2], e.worst_size[:2]
    frames = "" if len(e.worst_size) == 2 else f", {e.worst_size[2]} frames"  # a video model's most
    quantized = f", denoiser quantized {e.quantization}" if e.quantization else ""
    rows = [("weights on the GPU", e.gpu_weights, _parts(e.weights))]
    if e.host_weights:
        rows.append(("weights on the CPU (not counted)", sum(e.host_weights.values()), _parts(e.host_weights)))
    default_frames = f", {e.step_frames} frames" if e.step_frames else ""
    rows += [(f"step at {w}x{h}{default_frames}, {e.rows} rows", max(e.step.values()),
              f"{_parts(e.step)} ({e.decode_batch} images a decode)"),
             (f"worst step reserved ({ww}x{wh}{frames})", e.reserved, _parts(e.worst) + (
                 (f"; the decode stage's VAE in {e.decode_workers} decode process(es) off this GPU, its queue "
                  f"{_gib(e.decode_queue)}" if e.decode_workers else
                  f"; the decode stage's VAE beside the loop's, its queue {_gib(e.decode_queue)}") if e.decode_stage
                 else "") + (f"; the encode stage's {_encoders_at(e)}, its ready texts and starts "
                             f"{_gib(e.encode_ahead)}" if e.encode_stage else "")),
             ("needed: weights, context, worst step", e.needed, f"CUDA context assumed {_gib(e.context)}")]
    if e.decode_stage is None:
        rows.append(("needed with the decode stage (auto)", e.needed_for(True),
                     f"its VAE beside the loop's, its queue {_gib(e.decode_queue)}; on where the pool keeps half"))
    lines = [f"{e.model} ({e.family}) in {e.dtype}{quantized}, text encoders on the {e.encoder_device}"
             + (", VAE tiling" if e.vae_tiling else "")]
    lines += [f"{label:<40} {_gib(n):>7} GiB  {note}" for label, n, note in rows]
    lines.append(f"{f'state pool a request takes ({e.request_rows} row)':<40} {e.request_bytes / 2**20:>7.2f} MiB")
    for card, c in e.cards.items():
        room = f"{_gib(c['pool_bytes'])} GiB pool: {c['requests']} requests" if c["pool_bytes"] else \
            f"does not fit: {_gib(c['short_bytes'])} GiB short"
        if e.decode_stage is None and c["pool_bytes"]:
            room += f", decode stage {'on' if c['decode_stage'] else 'off'}"
        lines.append(f"{f'{card} GiB card, utilization {e.utilization:g}':<40} {room}")
    for phase, kernels in e.attention.items():
        lines.append(f"attention ({phase}): " + ", ".join(f"{k} x{n}" for k, n in kernels.items()))
    lines.append("Estimated on fake tensors (the peak of live tensors in a fake run), not measured on a GPU: fused "
                 "attention holds its output and logsumexp, as GPU flash and memory-efficient kernels do; the math "
                 "path holds every score.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the engine flags that change memory, as dvllm serve spells them, and the cards."""
    parser = argparse.ArgumentParser(prog="python -m dvllm.sizing.memory_estimate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"a preset, diffusers folder or Hub id ({', '.join(HUB_PRESETS)}"
                                                       " need no download)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="auto: the family's, as on a GPU")
    parser.add_argument("--vae-dtype", default="auto", choices=("auto", *DTYPES))
    parser.add_argument("--vae-tiling", action="store_true")
    parser.add_argument("--encoder-device", default=None, choices=("cpu",))
    parser.add_argument("--quantization", default=None, help="as dvllm serve's (BACKEND[:OPTION] or JSON)")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size)
    parser.add_argument("--max-image-pixels", type=int, default=None)
    parser.add_argument("--max-decode-batch", type=int, default=DEFAULTS.max_decode_batch)
    parser.add_argument("--max-num-frames", type=int, default=DEFAULTS.max_num_frames, help="video models")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS.gpu_memory_utilization)
    parser.add_argument("--decode-stage", action=argparse.BooleanOptionalAction, default=DEFAULTS.decode_stage)
    parser.add_argument("--max-decode-queue", type=int, default=DEFAULTS.max_decode_queue)
    parser.add_argument("--decode-workers", type=int, default=0, help="decode processes on another device")
    parser.add_argument("--encode-stage", action=argparse.BooleanOptionalAction, default=DEFAULTS.encode_stage)
    parser.add_argument("--max-encode-ahead", type=int, default=DEFAULTS.max_encode_ahead)
    parser.add_argument("--encode-workers", type=int, default=0, help="encode processes on another device")
    parser.add_argument("--size", default=None, help="HEIGHTxWIDTH of the typical step (default: the model's)")
    parser.add_argument("--cards", default=",".join(map(str, CARDS_GIB)), help="card sizes in GiB, comma-separated")
    parser.add_argument("--context-gib", type=float, default=CUDA_CONTEXT_GIB)
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cards = tuple(float(c) for c in args.cards.split(","))
        size = parse_size(args.size) if args.size else None
        result = estimate(args.model, args.dtype, args.encoder_device, args.quantization, args.max_batch_size, size,
                          args.max_image_pixels, args.max_decode_batch, args.gpu_memory_utilization, args.vae_dtype,
                          args.vae_tiling, cards, args.context_gib, args.decode_stage, args.max_decode_queue,
                          args.encode_stage, args.max_encode_ahead, args.decode_workers, args.encode_workers,
                          max_num_frames=args.max_num_frames)
    except ValueError as e:
        parser.error(str(e))
    print(render(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dataclasses.asdict(result) | {"gpu_weights": result.gpu_weights, "needed": result.needed}, f,
                      indent=1)


if __name__ == "__main__":
    main()
