"""A worker group decodes together: the VAE decoder's calls of one decode (a batch of finished requests, each
request's images in calls of their own; its tiles with --vae-tiling) are shared out across the group's members,
each holding a copy of the decoder.

The decode itself stays diffusers' own. The leader runs it twice around its decoder (`DecoderRouter`): the first
pass records each call the decoder gets and answers zeros of its output's shape; the recorded calls are decoded
across the group; the second pass answers each call with its decoded output, so the tiles' blending, the crops and
the post-processing are diffusers' as in a one-worker decode, and the image is that decode's (within the float
error of a decoder run in another process).

Which decoders are shared: AutoencoderKL's (SD 1.5, SDXL, SD3, Flux, Z-Image), whose decode calls its decoder
with the latents alone. Others (Qwen-Image's video VAE keeps a cache across its calls) decode on the leader alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Iterator

import torch

from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.parallel.row_split import chunk

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodeCalls:
    """A member's share of a decode: decoder inputs, on the CPU; its answer is their outputs, in order."""

    inputs: list[torch.Tensor]


def shares_decode(vae: Any) -> bool:
    """Whether this VAE's decoder calls can be decoded apart: AutoencoderKL's decode and tiled decode."""
    from diffusers import AutoencoderKL

    return isinstance(vae, AutoencoderKL) and type(vae).tiled_decode is AutoencoderKL.tiled_decode


def decoder_output_shape(vae: Any, latents: torch.Tensor) -> tuple[int, ...]:
    """The decoder's output shape for `latents` [B, C, h, w]: each up block but the last doubles the size."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    rows, _, height, width = latents.shape
    return rows, vae.config.out_channels, height * factor, width * factor


class UnsharedCall(RuntimeError):
    """A decoder call the router cannot record (extra arguments): the decode runs on the leader alone."""


class DecoderRouter:
    """Installed on the leader's VAE decoder: in its thread's recording pass each call is recorded and answered
    with zeros, in its replay pass with the next decoded output; otherwise (another thread, a preview) the decoder
    runs as it is."""

    def __init__(self, vae: Any) -> None:
        self.vae, self.decoder = vae, vae.decoder
        self._forward = self.decoder.forward
        self._local = threading.local()
        self.decoder.forward = self._route  # an instance attribute: the state dict and the class are untouched

    def remove(self) -> None:
        del self.decoder.forward

    def run(self, latents: torch.Tensor) -> torch.Tensor:
        """The decoder itself on one recorded call."""
        return self._forward(latents)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        calls: list[torch.Tensor] = []
        self._local.mode = ("record", calls)
        try:
            yield calls
        finally:
            self._local.mode = None

    @contextlib.contextmanager
    def replaying(self, outputs: list[torch.Tensor]) -> Iterator[None]:
        self._local.mode = ("replay", iter(outputs))
        try:
            yield
        finally:
            self._local.mode = None

    def _route(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mode = getattr(self._local, "mode", None)
        if mode is None:
            return self._forward(latents, *args, **kwargs)
        kind, calls = mode
        if args or kwargs:
            raise UnsharedCall(f"the VAE decoder was called with more than its latents ({len(args)} positional, "
                               f"{sorted(kwargs)})")
        if kind == "replay":
            return next(calls)
        calls.append(latents)
        return latents.new_zeros(decoder_output_shape(self.vae, latents))


def share_out(calls: list[torch.Tensor], size: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """The recorded calls as units of work: a call of at least `size` rows (images) cut into `size` slices of
    rows, a smaller one whole. Returns the units and, per call, its first unit and unit count."""
    units, spans = [], []
    for latents in calls:
        first = len(units)
        if len(latents) >= size:
            units += [latents[chunk(len(latents), rank, size)] for rank in range(size)]
        else:
            units.append(latents)
        spans.append((first, len(units) - first))
    return units, spans


def assign(units: list[torch.Tensor], size: int) -> list[list[int]]:
    """Each rank's units (indices), balanced by their sizes: the largest first, each to the least loaded rank (an
    edge tile is smaller than an inner one)."""
    shares: list[list[int]] = [[] for _ in range(size)]
    loads = [0] * size
    for i in sorted(range(len(units)), key=lambda i: -units[i].numel()):
        rank = loads.index(min(loads))
        shares[rank].append(i)
        loads[rank] += units[i].numel()
    return [sorted(share) for share in shares]


def put_together(outputs: list[torch.Tensor], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each call's output from its units' outputs."""
    return [outputs[first] if count == 1 else torch.cat(outputs[first:first + count]) for first, count in spans]


def decodes_in_group(config: ParallelConfig, vae: Any) -> bool:
    """Whether the group shares its decodes: asked for (group_decode, resolved: a group, and no decode workers,
    which decode in processes of their own), and a decoder that can be shared."""
    return config.group_decode and shares_decode(vae)


class SharedDecode:
    """The leader's decode, its decoder calls shared out across the group (WorkerGroup.decode_units)."""

    def __init__(self, group: Any, vae: Any) -> None:
        self.group, self.router = group, DecoderRouter(vae)

    def wrap(self, decode: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`decode` (the runner's: latents, images a request, image size -> images) run twice: recording, then
        replaying."""

        @functools.wraps(decode)
        def run(*args: Any) -> torch.Tensor:
            try:
                with self.router.recording() as calls:
                    decode(*args)
            except UnsharedCall as e:
                logger.warning("a decode runs on the leader alone: %s", e)
                return decode(*args)
            outputs = self._decode(calls)
            with self.router.replaying(outputs):
                return decode(*args)

        return run

    def _decode(self, calls: list[torch.Tensor]) -> list[torch.Tensor]:
        units, spans = share_out(calls, self.group.size)
        outputs = self.group.decode_units(units, self.router.run)
        return put_together(outputs, spans)
