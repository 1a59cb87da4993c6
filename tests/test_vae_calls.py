"""A request's images do not depend on what was decoded beside them: each request's go through the VAE in calls
of their own (dvllm/worker/vae_calls.py)."""
from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL

from dvllm.worker.vae_calls import decode_by_request


@pytest.fixture(scope="module")
def vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                         norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2).eval()


def test_each_requests_images_equal_its_own_decode(vae):
    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    calls: list[int] = []

    def decode(part: torch.Tensor, tiled: bool) -> torch.Tensor:
        assert not tiled  # none asked for
        calls.append(len(part))
        return vae.decode(part).sample

    with torch.no_grad():
        got = decode_by_request(decode, latents, [1, 2, 1], chunk=4)
        alone = [vae.decode(latents[0:1]).sample, vae.decode(latents[1:3]).sample, vae.decode(latents[3:4]).sample]
    assert calls == [1, 2, 1]
    torch.testing.assert_close(got, torch.cat(alone), rtol=0, atol=0)


def test_a_request_past_the_chunk_is_split_and_bad_counts_are_refused(vae):
    latents = torch.randn(3, 4, 8, 8)
    calls: list[int] = []
    out = decode_by_request(lambda part, tiled: calls.append(len(part)) or part * 2, latents, [3], chunk=2)
    assert calls == [2, 1] and torch.equal(out, latents * 2)
    with pytest.raises(ValueError, match="3 latents for requests of \\[2\\] images"):
        decode_by_request(lambda part, tiled: part, latents, [2], chunk=2)


def test_each_requests_calls_tile_as_asked():
    latents = torch.randn(5, 4, 8, 8)
    calls: list[tuple[int, bool]] = []
    decode_by_request(lambda part, tiled: calls.append((len(part), tiled)) or part, latents, [1, 3, 1], chunk=2,
                      tiled=[False, True, False])
    assert calls == [(1, False), (2, True), (1, True), (1, False)]
