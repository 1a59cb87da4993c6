"""How a batch of finished requests goes through the VAE: in calls of one request each.

An image must not depend on what was decoded beside it. A convolution's sums do: on the CPU oneDNN takes another
kernel for one image than for two or more (about 1e-6 apart a layer; a tiny VAE's decode 4e-6 on [0, 1] pixels,
and through tiling and an edit's image latents the combination matrix saw 1.2e-5), and on a GPU cuDNN chooses its
algorithm by shape too. So each request's images are decoded together, as its diffusers pipeline decodes them,
and never beside another request's: the batch still travels as one (one host copy, one message to a decode
process), only the VAE calls are per request. Decoding is not where batching pays (a VAE call of one 1024 px image
already fills a GPU); the denoiser's forward is.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)


def decode_by_request(decode: Callable[[torch.Tensor, bool], torch.Tensor], latents: torch.Tensor,
                      counts: Sequence[int], chunk: int, tiled: Sequence[bool] | None = None) -> torch.Tensor:
    """`latents` holds the requests' images in order, `counts[i]` of the i-th request's; each request's go through
    `decode(part, tiled[i])` together, at most `chunk` a call (the memory bound the profile measured); `tiled`:
    whose calls run in tiles (None: no one's)."""
    if sum(counts) != len(latents):
        raise ValueError(f"{len(latents)} latents for requests of {list(counts)} images")
    tiled = tiled or [False] * len(counts)
    parts = [decode(part, tiles) for request, tiles in zip(latents.split(list(counts)), tiled)
             for part in request.split(chunk)]
    return torch.cat(parts)


def can_tile(vae: Any) -> bool:
    """Whether the VAE decodes in tiles when asked (diffusers' enable_tiling / disable_tiling)."""
    return callable(getattr(vae, "enable_tiling", None)) and callable(getattr(vae, "disable_tiling", None))


@contextlib.contextmanager
def tiling(vae: Any, on: bool) -> Iterator[None]:
    """The VAE tiles inside when `on` (with the tile sizes it has), as it was after: a request's decode in tiles
    (dvllm/decode_budget.py). The caller holds the VAE's lock: the switch is the VAE's own attribute."""
    if not on or getattr(vae, "use_tiling", False):
        yield
        return
    vae.enable_tiling()
    try:
        yield
    finally:
        vae.disable_tiling()


def decode_call(vae: Any, tiles: bool, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One VAE call (`run`), tiled as asked; an untiled call that runs out of device memory runs again in tiles
    where the VAE tiles (logged: its images are the tiled decode's), rather than fail its request."""
    try:
        with tiling(vae, tiles):
            return run()
    except torch.OutOfMemoryError:
        if tiles or getattr(vae, "use_tiling", False) or not can_tile(vae):
            raise
    logger.warning("a VAE decode ran out of device memory; decoding it in tiles (max_decode_mb bounds decodes "
                   "ahead of time)")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tiling(vae, True):
        return run()
