"""A worker group decodes together (group_decode): the VAE decoder's calls of a decode, tiles with vae_tiling or
rows without, are shared out across the group and the images equal one worker's within 1e-5, with the decode stage
or in the loop, for a CFG-parallel and a sequence-parallel group; a member killed inside a decode loses nothing;
the recording pass leaves other threads' decodes alone; what is not shared decodes on the leader."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL

from dvllm import DiffusionEngine, SamplingParams
from dvllm.parallel.group_decode import (
    DecodeCalls,
    DecoderRouter,
    UnsharedCall,
    assign,
    put_together,
    share_out,
    shares_decode,
)

TOL = 1e-5
PROMPTS = ["a red circle", "a blue square on a green field"]


def _params(guidance: float) -> list[SamplingParams]:
    # 64x64 with the tiny VAE's 32-pixel tiles: 3x3 tiles an image; both finish together (a 2-row decode)
    return [SamplingParams(num_inference_steps=3, seed=i, height=64, width=64, guidance_scale=guidance,
                           output_type="np") for i in range(2)]


def _images(model: str, guidance: float, **config) -> tuple[list[np.ndarray], list[int] | None]:
    engine = DiffusionEngine(model=model, device="cpu", dtype="float32", max_image_pixels=4096, **config)
    try:
        outs = engine.generate(PROMPTS, _params(guidance), use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        group = engine.executor.worker.group
        return [o.images[0] for o in outs], None if group is None else list(group.units_decoded)
    finally:
        engine.shutdown()


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL


@pytest.mark.parametrize("fixture, guidance, group, tilings, stages", [
    ("sd_eps_path", 5.0, dict(cfg_parallel_size=2), (True, False), (None, False)),
    ("flux_path", 3.5, dict(sequence_parallel_size=2), (True,), (None,)),
])
@pytest.mark.slow
def test_a_group_shares_its_decodes_and_gives_the_one_worker_images(fixture, guidance, group, tilings, stages,
                                                                     request):
    model = request.getfixturevalue(fixture)
    for tiling in tilings:
        want, _ = _images(model, guidance, vae_tiling=tiling)
        for stage in stages:  # None: the decode stage's thread; False: the loop decodes
            got, units = _images(model, guidance, vae_tiling=tiling, decode_stage=stage, **group)
            _assert_close(got, want)
            # tiles (3x3 a decode) or, untiled, the decode's two rows: the member decodes its share
            assert units[1] > 0 and units[0] > 0, units
    _, units = _images(model, guidance, group_decode=False, **group)
    assert units == [0, 0]


@pytest.mark.slow
def test_a_member_killed_inside_a_decode_loses_nothing(sd_eps_path):
    want, _ = _images(sd_eps_path, 5.0, vae_tiling=True)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_image_pixels=4096,
                             vae_tiling=True, cfg_parallel_size=2, decode_stage=False)
    try:
        group = engine.executor.worker.group
        member, kills = group.members[0], []
        send = member.send

        def send_then_die(message):  # the member dies holding its share of the tiles
            send(message)
            if isinstance(message, DecodeCalls) and not kills:
                kills.append(member.pid)
                os.kill(member.pid, signal.SIGKILL)
                member.process.wait()

        member.send = send_then_die
        outs = engine.generate(PROMPTS, _params(5.0), use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        _assert_close([o.images[0] for o in outs], want)
        assert kills and group.restarts == 1 and member.alive and member.pid != kills[0]
        assert engine.stats()["stage_restarts"]["worker_group.members"] == 1
    finally:
        engine.shutdown()


def _tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                         norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2).eval()


@torch.no_grad()
def test_the_router_records_and_replays_its_own_thread_only():
    vae = _tiny_vae()
    vae.enable_tiling()
    latents = torch.randn(2, 4, 32, 32)
    want = vae.decode(latents).sample
    router = DecoderRouter(vae)
    other: list[torch.Tensor] = []
    with router.recording() as calls:
        vae.decode(latents)
        # another thread (the loop's previews while the stage records) decodes as it is
        thread = threading.Thread(target=lambda: other.append(vae.decode(latents).sample))
        thread.start()
        thread.join()
    assert len(calls) == 9 and torch.equal(other[0], want)
    units, spans = share_out(calls, 2)
    assert len(units) == 18 and spans[0] == (0, 2)  # each 2-row tile call cut into a row for each of two
    outputs = put_together([router.run(u) for u in units], spans)
    with router.replaying(outputs):
        got = vae.decode(latents).sample
    assert float((got - want).abs().max()) <= TOL
    with router.recording(), pytest.raises(UnsharedCall):
        vae.decoder(latents, None)  # a call with more than its latents cannot be recorded
    router.remove()
    assert torch.equal(vae.decode(latents).sample, want)


def test_only_autoencoder_kl_decodes_are_shared():
    from diffusers import AutoencoderKLQwenImage

    assert shares_decode(_tiny_vae())
    assert not shares_decode(AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                                    temperal_downsample=[False, True]))


def test_tiles_are_shared_out_by_size():
    # 1024x1024 in 512-pixel tiles: four inner 64x64 latents, four 64x32 edges, one 32x32 corner
    sides = [(64, 64), (64, 64), (64, 32), (64, 64), (64, 64), (64, 32), (32, 64), (32, 64), (32, 32)]
    units = [torch.zeros(1, 16, h, w) for h, w in sides]
    shares = assign(units, 2)
    assert sorted(shares[0] + shares[1]) == list(range(9))
    loads = [sum(units[i].numel() for i in share) for share in shares]
    assert max(loads) <= 1.1 * sum(loads) / 2, loads  # a count split (5 and 4 tiles) would give 18432 and 7168
