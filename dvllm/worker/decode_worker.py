"""Decode workers (EngineConfig.decode_workers): processes of their own, each holding a copy of the model's VAE
on the CPU or another GPU, that decode the decode stage's batches and convert them to the output type, so that
neither the VAE nor PIL runs in the worker's process (its GIL) or, on GPUs, on its device.

The decode stage gives each process a lane: a thread that sends it a batch (latents on the host, small) and
waits for the images. The process (stage_process.py) is spawned when the worker starts (its imports overlap the
engine's first steps) and gets its VAE copy with the first batch. A process found dead is spawned again and
raises WorkerProcessLost to the lane, which decodes the batch once more: no request is lost to a killed process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dvllm.runtime.channel import Channel
from dvllm.worker.output_types import to_output_type
from dvllm.worker.stage_process import StageProcess, check_devices, serve
from dvllm.worker.vae_calls import decode_by_request, decode_call

logger = logging.getLogger(__name__)


@dataclass
class VaeCopy:
    """What an adapter's decode reads of its pipeline (the VAE, the image processor, the latents' unpacking) as
    plain data a process rebuilds it from: the VAE's class, config, weights on the host and switches."""

    adapter_cls: type
    pipeline_cls: type
    vae_cls: type
    vae_config: dict[str, Any]
    state: dict[str, torch.Tensor]
    switches: dict[str, Any]  # tiling and slicing, as the engine's VAE has them
    training: bool  # its mode too: dummy weights are built in training mode, whose dropout changes layouts
    parts: dict[str, Any]  # the pipeline's processors and scale factors that decode reads (_DECODE_PARTS)

    @classmethod
    def of(cls, adapter: Any) -> VaeCopy:
        pipeline = adapter.pipeline
        vae = pipeline.vae
        check_copyable(vae)
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in vae.state_dict().items()}
        switches = {k: v for k, v in vars(vae).items()
                    if k.startswith(("use_", "tile_")) and isinstance(v, (bool, int, float))}
        # an image pipeline's decode reads its image processor, a video pipeline's (Wan) its video processor
        parts = {name: getattr(pipeline, name) for name in _DECODE_PARTS if hasattr(pipeline, name)}
        return cls(type(adapter), type(pipeline), type(vae), dict(vae.config), state, switches, vae.training, parts)

    def build(self, device: torch.device) -> VaeDecoder:
        vae = self.vae_cls.from_config(self.vae_config)
        vae.load_state_dict(self.state, strict=True, assign=True)  # each weight keeps its dtype
        for name, value in self.switches.items():
            setattr(vae, name, value)
        vae.to(device).train(self.training)
        return VaeDecoder(self.adapter_cls, _DecodeParts(vae, self.parts, self.pipeline_cls))


def check_copyable(vae: torch.nn.Module) -> None:
    """ValueError unless every weight of the VAE is a plain float tensor (what a copy can carry)."""
    for name, tensor in vae.state_dict().items():
        if type(tensor) is not torch.Tensor or not tensor.is_floating_point():
            raise ValueError(f"decode_workers: the VAE's {name} is not a plain float tensor (a quantized VAE?); "
                             "decode workers copy plain weights only")


# What an adapter's decode may read of its pipeline besides the VAE (each where the pipeline has it)
_DECODE_PARTS = ("image_processor", "video_processor", "vae_scale_factor", "vae_scale_factor_spatial",
                 "vae_scale_factor_temporal")


class _DecodeParts:
    """The parts of a diffusers pipeline an adapter's decode reads."""

    def __init__(self, vae: Any, parts: dict[str, Any], pipeline_cls: type) -> None:
        self.vae = vae
        for name, value in parts.items():
            setattr(self, name, value)
        self._unpack_latents = getattr(pipeline_cls, "_unpack_latents", None)  # a staticmethod where it exists


class VaeDecoder:
    """The adapter's own decode, run on the parts alone (ModelAdapter.decode reads only self.pipeline's)."""

    def __init__(self, adapter_cls: type, pipeline: _DecodeParts) -> None:
        self.pipeline = pipeline
        self._decode = adapter_cls.decode

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        return self._decode(self, latents, image_size)


# A batch: latents on the host, (height, width), each job's (image count, output type, whether its calls tile),
# and the most images one VAE call takes (max_decode_batch, as the worker's own decode chunks them)
Batch = tuple[torch.Tensor, tuple[int, int], list[tuple[int, str, bool]], int]


class DecodeWorker(StageProcess):
    """One decode process: gets its VAE copy with the first batch, answers each with each job's images."""

    kind = "decode"
    target = "dvllm.worker.decode_worker:main"
    process_name = "dvllm-decode"

    def decode(self, batch: Batch) -> list[list[Any]]:
        return self.call(batch)


def _decode_batch(decoder: VaeDecoder, batch: Batch, device: torch.device) -> list[list[Any]]:
    latents, size, jobs, chunk = batch

    def decode(part: torch.Tensor, tiles: bool) -> torch.Tensor:
        return decode_call(decoder.pipeline.vae, tiles, lambda: decoder.decode(part, size))

    pixels = decode_by_request(decode, latents.to(device), [n for n, _, _ in jobs], chunk, [t for _, _, t in jobs])
    answer, lo = [], 0
    for n, output_type, _ in jobs:
        answer.append(to_output_type(pixels[lo:lo + n], output_type))
        lo += n
    return answer


def start_decode_workers(adapter: Any, count: int, devices: list[str], worker_device: torch.device) -> list[DecodeWorker]:
    """`count` decode processes placed in turn on `devices` (those this process sees: a Ray worker's are on its
    node); on a GPU worker none may share its GPU (there the decode stage's thread decodes with no second VAE)."""
    check_devices(devices, worker_device, "decode_device", "on its own GPU the decode stage's thread decodes")
    check_copyable(adapter.pipeline.vae)
    # As many intra-op threads as the worker's: the CPU's kernels split their sums by the thread count, and an
    # image must not depend on the process that decoded it
    threads = torch.get_num_threads()
    logger.info("%d decode worker process(es) on %s", count, ", ".join(devices))
    return [DecodeWorker(lambda: VaeCopy.of(adapter), devices[i % len(devices)], threads, i) for i in range(count)]


def main(channel: Channel, device: str) -> None:
    """The process's target (dvllm.runtime.spawn)."""
    serve(channel, device, lambda copy, device: copy.build(device), _decode_batch)
