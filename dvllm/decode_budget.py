"""Which decodes run in tiles: a request whose untiled VAE decode is estimated above the decode's memory bound
(max_decode_mb) decodes tiled, that request only. Decided once, at admission (engine/input_processor.py), from
what each worker measured at its start (worker/decode_tiling.py); torch-free, so the driver holds it."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBudget:
    """limit_bytes: what one decode call may take (None: no bound, nothing tiles); bytes_per_pixel: an untiled
    call's peak per output pixel (height x width x frames x images), measured on one decode at start; can_tile:
    whether the model's VAE decodes in tiles (diffusers' enable_tiling)."""

    limit_bytes: int | None = None
    bytes_per_pixel: float = 0.0
    can_tile: bool = False

    def estimate(self, size: tuple[int, ...], images: int) -> int:
        """Bytes an untiled call on `images` images of `size` ((height, width) or (height, width, frames)) takes:
        an estimate, linear in the pixels it makes."""
        return math.ceil(self.bytes_per_pixel * images * math.prod(size))

    def tiles(self, size: tuple[int, ...], images: int) -> bool:
        """Whether such a call decodes tiled: its estimate is over the limit and the VAE can tile."""
        return self.can_tile and self.limit_bytes is not None and self.estimate(size, images) > self.limit_bytes

    def tightest(self, other: DecodeBudget) -> DecodeBudget:
        """The bound that holds on both workers: the lower limit, the larger per-pixel estimate."""
        limits = [x for x in (self.limit_bytes, other.limit_bytes) if x is not None]
        return DecodeBudget(min(limits) if limits else None, max(self.bytes_per_pixel, other.bytes_per_pixel),
                            self.can_tile and other.can_tile)
