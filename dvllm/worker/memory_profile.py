"""How much GPU memory the state pool may take: what gpu_memory_utilization leaves once the weights are
in and the worst step the engine's limits allow has shown its peak.

A step runs three kinds of work, one after another, each with its own transient memory: the text
encoders on a full admission batch (every new request with a prompt and a negative prompt; nothing on this
device when encoder_device puts them elsewhere or encode workers hold them, and their weights are then not
here either), the
denoiser on a full forward (max_batch_size rows, padded up to its bucket when batches are padded) at
the largest size max_image_pixels allows, and the VAE on a decode chunk (max_decode_batch images at
that size; the runner never decodes more at once). Each is run once here on zeros and its peak taken;
the pool gets what is left under the largest. CUDA graphs share one memory pool (worker/denoiser.py),
whose size is at most one forward's activations: that much more is held back when they are on.
Each captured graph also keeps its own static inputs (the latents and conditions of its bucket's rows):
max_cuda_graphs sets of the worst forward's inputs are held back with them.
With LoRA serving on, the slot tables (worker/lora_layers.py) are held back too, at their largest: every
Linear and Conv2d layer an adapter could change, max_loras slots of max_lora_rank (they are allocated as
adapters first touch each layer, so what they will grow to is counted before the pool takes the rest).
Step caching updates each request's kept state in place in the pool (worker/step_cache_hooks.py); what a
caching forward holds beyond a plain one is two hidden-stream tensors of the batch (first_block's head
residual, or TaylorSeer's predicted outputs, held across the blocks; and the batch put back together at
the tail): counted on top of the denoiser's peak for the families that serve it.
With controlnets loaded, the worst forward has controls on every row: MAX_CONTROLS of them a request, each
running the largest controlnet on all rows (worker/unet_controlnet.py's hook, as serving runs it; the UNet
families', the DiT families' forwards are profiled without control rows yet), so their activations and the
residual sums the UNet is handed are in the denoiser's peak. The control inputs a forward's groups keep on the
device outside the pool (MAX_CONTROLS a row, in the controlnets' dtype) are held back as well; the prepared images
themselves are pool state.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from dvllm.config import EngineConfig
from dvllm.controls import MAX_CONTROLS
from dvllm.decode_budget import DecodeBudget
from dvllm.lora.weights import servable
from dvllm.models.base import ModelAdapter, ModelInfo
from dvllm.models.layout import BatchLayout
from dvllm.worker.control_plan import ControlGroup, ControlPlan
from dvllm.worker.denoiser import batch_buckets
from dvllm.worker.forward_context import ForwardContext, ForwardHooks
from dvllm.worker.unet_controlnet import ControlResiduals
from dvllm.worker.vae_calls import tiling

logger = logging.getLogger(__name__)
_PROBE_TEXT = "a long prompt that fills every text encoder's token window " * 64  # truncated by each tokenizer


class DeviceMemory:
    """The device memory queries the sizing needs (tests give a fake one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def measure(self, run: Callable[[], None]) -> int:
        """Bytes that `run` allocated at its peak beyond what was allocated before it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


def largest_size(info: ModelInfo, max_pixels: int, max_frames: int | None = None) -> tuple[int, ...]:
    """The largest square (height, width) in multiples of the size factor that max_pixels allows; a video
    model's with the most frames max_frames allows after them."""
    factor = info.latents.size_factor
    side = max(factor, min(math.isqrt(max_pixels), info.latents.max_side or max_pixels) // factor * factor)
    if info.video is None:
        return side, side
    step, frames = info.video.frame_multiple, max_frames or info.video.frames
    if info.video.max_frames is not None:
        frames = min(frames, info.video.max_frames)
    return side, side, (max(1, frames) - 1) // step * step + 1


def worst_size(info: ModelInfo, config: EngineConfig) -> tuple[int, ...]:
    """The largest request the engine's limits allow."""
    return largest_size(info, info.pixel_limit(config.max_image_pixels), config.max_num_frames)


def worst_forward(adapter: ModelAdapter, config: EngineConfig) -> tuple[int, tuple[int, ...]]:
    """(rows, size) of the largest forward the engine's limits allow."""
    rows = config.max_batch_size
    if config.compile == "bucketed" or config.cuda_graph:  # batches are padded up to their bucket
        rows = next(b for b in batch_buckets(2 * rows) if b >= rows)
    return rows, worst_size(adapter.info, config)


def step_peaks(adapter: ModelAdapter, config: EngineConfig, memory: DeviceMemory,
               decode_budget: DecodeBudget | None = None, controlnets: dict[str, Any] | None = None) -> dict[str, int]:
    """Peak transient bytes of each kind of work in the worst step (the worst decode tiled where the budget
    tiles it; the worst forward with controls on every row where `controlnets`, the engine's, are given)."""
    info = adapter.info
    rows, size = worst_forward(adapter, config)
    height, width = size[:2]
    texts = [(_PROBE_TEXT[:config.max_prompt_chars], negative) for _ in range(config.max_batch_size)
             for negative in (False, True)]
    device, dtype = adapter.device, adapter.state_dtype

    def denoise() -> None:
        latents = torch.zeros((rows, *info.latents.shape(*size)), dtype=dtype, device=device)
        # masks all ones: every text at its longest, the worst case (zeros would cut the text to nothing)
        conditions = {k: (torch.ones if k.endswith("_mask") else torch.zeros)((rows, *shape), dtype=dtype,
                                                                               device=device)
                      for k, shape in info.text.condition_shapes.items()}
        if info.images.denoiser_takes_inputs:  # the most input state a row can bring
            conditions["image_inputs"] = torch.zeros((rows, info.most_input_numel(*size)), dtype=dtype,
                                                     device=device)
        per_row = {"guidance": (info.defaults.guidance,) * rows}
        if "prompt_embeds_mask" in info.text.condition_shapes:
            longest = info.text.condition_shapes["prompt_embeds_mask"][0]
            per_row["text_lengths"] = ((longest, longest),) * rows
        if info.images.edit_grids is not None:  # as many square images as it takes, at the pipeline's VAE area
            grids = info.images.edit_grids(((height, height),) * info.images.max_images)
            per_row["image_grids"] = (tuple(x for g in grids for x in g),) * rows
        layout = BatchLayout.single(size, rows, **per_row)
        for key, value in adapter.step_conditions(layout, dtype).items():
            conditions[key] = value.to(device)
        ones = torch.ones(rows, device=device)
        with _every_row_controlled(adapter, controlnets, layout, rows, (height, width)):
            adapter.denoise(latents, ones * 500, conditions, ones * info.defaults.guidance, layout)

    def decode() -> None:
        latents = torch.zeros((config.max_decode_batch, *info.latents.shape(*size)), dtype=dtype, device=device)
        tiled = decode_budget is not None and decode_budget.tiles(size, config.max_decode_batch)
        with tiling(adapter.pipeline.vae, tiled):
            adapter.decode(latents, size)

    def encode() -> None:
        texts_here = not config.encode_workers  # encode workers encode them in processes of their own
        if info.images.video_numel is not None:  # image-to-video: the VAE encodes the image's condition frames
            from PIL import Image

            if texts_here:
                adapter.encode_prompt(texts)
            adapter.prepare_image_to_video(Image.new("RGB", (width, height)), config.max_images_per_prompt, height,
                                           width, size[2], torch.Generator("cpu").manual_seed(0), 1.0)
            return
        if info.images.edit_grids is None:
            if texts_here:
                adapter.encode_prompt(texts)
            if config.encode_stage and info.images.img2img:  # the stage makes img2img starts too, beside the forward
                from PIL import Image

                adapter.encode_image(Image.new("RGB", (width, height)), config.max_images_per_prompt, height, width,
                                     torch.Generator("cpu").manual_seed(0), (1.0, 0.0))
            return
        # an edit model encodes its images at admission too, and may read each prompt with them
        from PIL import Image

        images = tuple(Image.new("RGB", (height, height)) for _ in range(info.images.max_images))
        if texts_here and info.text.reads_images:
            adapter.encode_prompt([("x", False)], images=images)
        elif texts_here:
            adapter.encode_prompt(texts)
        adapter.prepare_edit(images, 1, height, width, torch.Generator("cpu").manual_seed(0))

    peaks = {}
    with torch.inference_mode():
        for name, run in (("encode", encode), ("denoise", denoise), ("decode", decode)):
            try:
                peaks[name] = memory.measure(run)
            except torch.OutOfMemoryError:
                raise ValueError(
                    f"the worst step this engine's limits allow does not fit the GPU: {name} ran out of memory "
                    f"({rows} rows at {width}x{height}, {config.max_decode_batch} images a decode); lower "
                    "max_batch_size, max_image_pixels or max_decode_batch"
                    f"{' (or set max_decode_mb: larger decodes run tiled)' if name == 'decode' else ''}") from None
    peaks["denoise"] += step_cache_bytes(info, rows, size, dtype)
    return peaks


@contextmanager
def _every_row_controlled(adapter: ModelAdapter, controlnets: dict[str, Any] | None, layout: BatchLayout, rows: int,
                          size: tuple[int, int]) -> Iterator[None]:
    """The forward inside runs with MAX_CONTROLS controls on every row, each the largest controlnet (by its
    weights), through the serving hook (installed for the span); nothing without controlnets."""
    if not controlnets or adapter.controlnet_class != "ControlNetModel":  # (the UNet's; the DiTs' not yet)
        yield
        return
    net = max(controlnets.values(), key=lambda n: sum(p.numel() for p in n.parameters()))
    device = adapter.device
    index = torch.arange(rows, device=device)
    guidance = torch.ones(rows, device=device)
    # each group its own images, as the planner gathers them
    groups = [ControlGroup(net, index, torch.zeros((rows, 3, *size), dtype=net.dtype, device=device), 1.0, False,
                           guidance) for _ in range(MAX_CONTROLS)]
    hooks = ForwardHooks()
    residuals = ControlResiduals(adapter.pipeline.unet, hooks)
    try:
        with hooks.running(ForwardContext(layout=layout, control=ControlPlan(groups))):
            yield
    finally:
        residuals.handle.remove()


def control_image_bytes(adapter: ModelAdapter, config: EngineConfig, controlnets: dict[str, Any] | None) -> int:
    """The control inputs one forward's groups keep on the device outside the pool (the planner's gathered images,
    kept while the groups' members stay: MAX_CONTROLS a row at the largest size, in the widest controlnet dtype; an
    upper bound for the families whose inputs are latents); 0 without controlnets."""
    if not controlnets:
        return 0
    height, width = worst_size(adapter.info, config)[:2]
    element = max(torch.empty((), dtype=n.dtype).element_size() for n in controlnets.values())
    return config.max_batch_size * MAX_CONTROLS * 3 * height * width * element


def worst_transient(peaks: dict[str, int], decode_stage: bool, encode_stage: bool = False) -> int:
    """The most transient memory at once: one kind of work at a time, but the decode stage's VAE runs beside
    the loop's work, and so do the encode stage's text encoders."""
    loop = [peaks["denoise"]]
    loop += [] if encode_stage else [peaks["encode"]]
    loop += [] if decode_stage else [peaks["decode"]]
    return max(loop) + (peaks["encode"] if encode_stage else 0) + (peaks["decode"] if decode_stage else 0)


def encode_ahead_bytes(adapter: ModelAdapter, config: EngineConfig) -> int:
    """What the encode stage may hold ready: max_encode_ahead items, each a text's conditions or the start of a
    request with input images (its latents and input state, n images at the largest size)."""
    if not config.encode_stage:
        return 0
    info = adapter.info
    element = torch.empty((), dtype=adapter.state_dtype).element_size()
    item = info.text.condition_numel
    images = info.images
    if images.img2img or images.inpaint_channels or images.edit_grids is not None or images.video_numel is not None:
        size = worst_size(info, config)  # a start made ahead: the latents and the input state of each image
        item = max(item, config.max_images_per_prompt * (info.latents.numel(*size) + info.most_input_numel(*size)))
    return config.max_encode_ahead * item * element


def choose_decode_stage(asked: bool | None, pool_bytes: Callable[[bool], int]) -> bool:
    """The decode stage as asked; auto (None): on unless reserving its VAE beside the loop's work, and its queue,
    leaves the state pool (`pool_bytes(stage)`) less than half of what it has without the stage."""
    if asked is not None:
        return asked
    with_stage = pool_bytes(True)
    return with_stage > 0 and 2 * with_stage >= pool_bytes(False)


def decode_queue_bytes(adapter: ModelAdapter, config: EngineConfig, decode_stage: bool) -> int:
    """The latents the decode stage may hold (max_decode_queue images at the largest size), each its own copy."""
    if not decode_stage:
        return 0
    info = adapter.info
    element = torch.empty((), dtype=adapter.state_dtype).element_size()
    return config.max_decode_queue * info.latents.numel(*worst_size(info, config)) * element


def _forward_input_bytes(info: ModelInfo, rows: int, size: tuple[int, ...], dtype: torch.dtype) -> int:
    """A forward's inputs: what a captured graph keeps as its static buffers."""
    height, width = size[:2]
    numel = math.prod(info.latents.shape(*size)) + sum(math.prod(s) for s in info.text.condition_shapes.values())
    if info.images.denoiser_takes_inputs:
        numel += info.most_input_numel(*size)
    return rows * (numel * torch.empty((), dtype=dtype).element_size() + 2 * 4)  # and the float32 step columns


def step_cache_bytes(info: ModelInfo, rows: int, size: tuple[int, ...], dtype: torch.dtype) -> int:
    """What a caching forward holds beyond a plain one (0 where the family serves no step caching): two
    hidden-stream tensors of every row, at the longest text the family keeps."""
    layout = info.cache_layout
    if layout is None:
        return 0
    shapes = info.text.condition_shapes
    text = layout.text_tokens or (shapes["prompt_embeds"][0] if "prompt_embeds" in shapes else 0)
    height, width, *frames = size
    tokens = layout.tokens(layout.hidden_kind, height, width, text, *frames)
    return 2 * rows * tokens * layout.inner_dim * torch.empty((), dtype=dtype).element_size()


def lora_table_bytes(adapter: ModelAdapter, config: EngineConfig) -> int:
    """The most the LoRA slot tables can grow to: A and B of max_lora_rank for every Linear and Conv2d layer
    an adapter may change (worker/lora_layers.py), and a bias of B for every Linear one, in every LoRA-loadable
    component, in each of max_loras slots (0 without LoRA serving)."""
    if not config.enable_lora:
        return 0
    per_rank = biases = 0
    for name in getattr(type(adapter.pipeline), "_lora_loadable_modules", ()):
        model = getattr(adapter.pipeline, name, None)
        if isinstance(model, torch.nn.Module):
            layers = [m for m in model.modules() if servable(m)]
            per_rank += sum(_table_numel_per_rank(m) * m.weight.element_size() for m in layers)
            biases += sum(m.out_features * m.weight.element_size() for m in layers
                          if isinstance(m, torch.nn.Linear))
    return (per_rank * config.max_lora_rank + biases) * config.max_loras


def _table_numel_per_rank(module: torch.nn.Module) -> int:
    """Elements of one slot's A and B per unit of rank, for a servable layer: A [in] (a conv's [in, kh, kw])
    and B [out]."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features + module.out_features
    return module.in_channels * math.prod(module.kernel_size) + module.out_channels


def gpu_pool_bytes(adapter: ModelAdapter, config: EngineConfig, memory: DeviceMemory,
                   decode_budget: DecodeBudget | None = None,
                   controlnets: dict[str, Any] | None = None) -> tuple[int, bool]:
    """What the state pool may take on this GPU, and whether the decode stage runs (choose_decode_stage);
    ValueError when the worst step leaves nothing. `controlnets`: the engine's (their rows and images counted)."""
    peaks = step_peaks(adapter, config, memory, decode_budget, controlnets)
    graphs = 0
    if config.cuda_graph:  # their shared pool (one forward's activations) and each one's static inputs
        rows, size = worst_forward(adapter, config)
        inputs = _forward_input_bytes(adapter.info, rows, size, adapter.state_dtype)
        graphs = peaks["denoise"] + config.max_cuda_graphs * inputs
    loras = lora_table_bytes(adapter, config)
    images = control_image_bytes(adapter, config, controlnets)
    free, total = memory.free_and_total()
    used = total - free  # the weights, the CUDA context, anything else on the device

    def transient_bytes(stage: bool) -> int:
        beside = stage and not config.decode_workers  # decode worker processes decode on other devices
        return (worst_transient(peaks, beside, config.encode_stage) + decode_queue_bytes(adapter, config, stage)
                + encode_ahead_bytes(adapter, config))

    def pool_bytes(stage: bool) -> int:
        return int(total * config.gpu_memory_utilization) - used - transient_bytes(stage) - graphs - loras - images

    stage = choose_decode_stage(True if config.decode_workers else config.decode_stage, pool_bytes)
    transient, budget = transient_bytes(stage), pool_bytes(stage)
    beside = stage and not config.decode_workers
    gib = 2**30
    if config.decode_stage is None:
        logger.info("decode stage %s: with it the state pool gets %.2f GiB, without it %.2f GiB (auto: on unless "
                    "that halves the pool; --decode-stage or --no-decode-stage choose)", "on" if stage else "off",
                    max(pool_bytes(True), 0) / gib, max(pool_bytes(False), 0) / gib)
    logger.info("worst step: %s GiB peak (encode %.2f, denoise %.2f, decode %.2f%s)%s%s%s; %.2f GiB in use",
                f"{transient / gib:.2f}", peaks["encode"] / gib, peaks["denoise"] / gib,
                peaks["decode"] / gib, ", the decode stage's beside the loop's" if beside else "",
                f", CUDA graphs {graphs / gib:.2f}" if graphs else "",
                f", LoRA slots {loras / gib:.2f}" if loras else "",
                f", control images {images / gib:.2f}" if images else "", used / gib)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the state pool: the model uses {used / gib:.1f} GiB and its worst step "
            f"{transient / gib:.1f} GiB more ({', '.join(f'{k} {v / gib:.1f}' for k, v in peaks.items())}"
            f"{'; the decode stage decodes beside the loop' if beside else ''})"
            f"{f' plus {graphs / gib:.1f} for CUDA graphs' if graphs else ''}"
            f"{f' plus {loras / gib:.1f} for LoRA slots' if loras else ''}"
            f"{f' plus {images / gib:.1f} for control images' if images else ''}, of {total / gib:.1f} GiB with "
            f"gpu_memory_utilization={config.gpu_memory_utilization}; raise it, or lower max_batch_size, "
            f"max_image_pixels or max_decode_batch{' (or max_loras, max_lora_rank)' if loras else ''}"
            f"{' (or turn the decode stage off: --no-decode-stage)' if beside else ''}"
        )
    return budget, stage
