"""Training targets for the built-in models without sampling noise: the exact posterior mean.

The scenes are a finite set (every colour x shape x size x position), and a caption names some of
their attributes, so the scenes a caption allows are known. For a noisy latent
x_t = a * x0 + s * noise, the best possible denoiser is the posterior mean over those scenes:
E[x0 | x_t, caption] = sum_i w_i x0_i, with w_i proportional to exp(-|x_t - a x0_i|^2 / (2 s^2)).
Regressing on it instead of on the one noise that was drawn removes the target's variance (the
idea of "stable target field" training, here with the whole data set as the reference batch), so
a small model learns the scenes in far fewer steps. An empty caption allows every scene: the
unconditional model that classifier-free guidance subtracts.
"""
from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import torch

from dvllm.tiny_shapes.data import COLORS, POSITIONS, SHAPES, SIZES, Scene

CFG_DROPOUT = 0.1  # share of empty captions: the unconditional model classifier-free guidance needs


def all_scenes() -> list[Scene]:
    return [Scene(*combo) for combo in itertools.product(COLORS, SHAPES, SIZES, POSITIONS)]


def render_all(scenes: list[Scene]) -> torch.Tensor:
    """[N, 3, 64, 64] in [-1, 1]."""
    pixels = np.stack([np.asarray(s.render(), dtype=np.float32) / 127.5 - 1.0 for s in scenes])
    return torch.from_numpy(pixels).permute(0, 3, 1, 2)


class CaptionSampler:
    """Draws training captions, and for each the mask of scenes it allows. Scenes have a colour, shape and size,
    and a fourth attribute named by `where` among `places` (a picture's position; a video's motion): a caption
    that names one allows only the scenes that have it."""

    def __init__(self, scenes: list[Any], seed: int, where: str = "position", places: Any = POSITIONS) -> None:
        self.scenes, self.places = scenes, list(places)
        self.rng = random.Random(seed)
        self.attributes = torch.tensor([[list(COLORS).index(s.color), SHAPES.index(s.shape), list(SIZES).index(s.size),
                                         self.places.index(getattr(s, where))] for s in scenes])

    def draw(self, batch: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(captions, allowed [batch, scenes] bool, the scene each caption was drawn from)."""
        picks = [self.rng.randrange(len(self.scenes)) for _ in range(batch)]
        captions, allowed = [], torch.zeros(batch, len(self.scenes), dtype=torch.bool)
        for row, index in enumerate(picks):
            if self.rng.random() < CFG_DROPOUT:
                captions.append("")
                allowed[row] = True
                continue
            text = self.scenes[index].caption(self.rng)
            captions.append(text)
            named = self.attributes[index]
            keep = (self.attributes[:, 0] == named[0]) & (self.attributes[:, 1] == named[1])
            if any(size in text.split() for size in SIZES):
                keep &= self.attributes[:, 2] == named[2]
            if any(place in text for place in self.places):
                keep &= self.attributes[:, 3] == named[3]
            allowed[row] = keep
        return captions, allowed, torch.tensor(picks)


def posterior_mean(noisy: torch.Tensor, signal: torch.Tensor, noise_std: torch.Tensor, scenes: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """E[x0 | noisy, caption] for noisy = signal * x0 + noise_std * noise, x0 uniform over the allowed scenes.

    noisy [B, ...]; signal, noise_std [B]; scenes [N, ...] (every scene's clean latents); allowed [B, N] bool.
    """
    flat, bank = noisy.flatten(1), scenes.flatten(1)
    # |noisy - a x0_i|^2 = |noisy|^2 - 2a <noisy, x0_i> + a^2 |x0_i|^2; the first term is the same for every i
    logits = (2 * signal[:, None] * (flat @ bank.T) - signal[:, None] ** 2 * bank.square().sum(1)[None])
    logits = logits / (2 * noise_std[:, None] ** 2)
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=1)
    return (weights @ bank).view_as(noisy)
