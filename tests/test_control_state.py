"""Control images as state-pool entries: requests (and controls of one request) that send the same image hold one
copy; a preempted controlled request takes its images to host memory and back (refilling an entry evicted while it
was out); a controlled request is stored in the result cache, keyed by its controls' images too; and a control
image larger than the pool is refused at admission."""
import numpy as np
import pytest
from test_controlnet import control, control_image, tiny_controlnet

from dvllm import DiffusionEngine, SamplingParams
from dvllm.core.block_manager import BlockManager
from dvllm.core.request_blocks import allocate_blocks, blocks_needed, free_blocks

P = SamplingParams


@pytest.fixture(scope="module")
def controlnets(sd_eps_path, tmp_path_factory) -> dict[str, str]:
    from diffusers import StableDiffusionPipeline

    folder = tmp_path_factory.mktemp("controlnet")
    tiny_controlnet(StableDiffusionPipeline.from_pretrained(sd_eps_path).unet, 10).save_pretrained(folder)
    return {"edges": str(folder)}


@pytest.fixture(scope="module")
def engine(sd_eps_path, controlnets):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=controlnets,
                             scheduling_policy="priority", max_batch_size=2)
    yield engine
    engine.shutdown()


def params(image_seed: int = 1, seed: int = 1, steps: int = 4, **kw) -> SamplingParams:
    kw = {"height": 16, "width": 16, **kw}
    return P(num_inference_steps=steps, guidance_scale=1.0, seed=seed, output_type="np",
             controls=[control("edges", control_image(image_seed))], **kw)


def alone(engine: DiffusionEngine, p: SamplingParams) -> np.ndarray:
    return engine.generate(["a house"], [P(**{**vars(p), "priority": 0})], use_tqdm=False)[0].images[0]


def run(engine: DiffusionEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


def test_requests_sending_one_image_share_its_entry(engine):
    scheduler = engine.scheduler
    same, twice = params(seed=2), params(seed=3)
    twice = P(**{**vars(twice), "controls": [control("edges", control_image(1)), control("edges", control_image(1),
                                                                                          scale=0.5)]})
    expected = {"same": alone(engine, same), "twice": alone(engine, twice)}
    engine.add_request("same", "a house", same)
    engine.add_request("twice", "a house", twice)
    engine.add_request("other", "a house", params(image_seed=7, seed=4))
    engine.step()
    a, b, c = (scheduler.requests[r] for r in ("same", "twice", "other"))
    assert a.control_entries[0] is b.control_entries[0] is b.control_entries[1]  # one copy of image 1
    assert c.control_keys[0] != a.control_keys[0] and not c.control_entries  # another image; it waits for a row
    assert a.control_entries[0].refs == 3
    outs = run(engine)
    for name in expected:
        assert outs[name].error is None, outs[name].error
        assert float(np.abs(outs[name].images[0] - expected[name]).max()) <= 1e-6


@pytest.mark.parametrize("evicted", [False, True])
def test_a_preempted_controlled_request_comes_back_with_the_same_image(engine, evicted):
    scheduler = engine.scheduler
    low = params(seed=5 + evicted, steps=6, priority=5)
    expected = alone(engine, low)
    engine.add_request("low", "a house", low)
    for _ in range(2):
        engine.step()
    engine.add_request("urgent", "a boat", P(height=16, width=16, num_inference_steps=2, guidance_scale=1.0, n=2,
                                             seed=9, priority=-5))
    while "urgent" in scheduler.requests and "urgent" not in scheduler.decoding:
        engine.step()
    request = scheduler.requests["low"]
    assert request.swapped
    if evicted:  # its image's entry dropped while it was out: resuming must write it again from its host copy
        key = request.control_keys[0]
        scheduler.blocks.invalidate(scheduler.blocks.index[key])
        pool = engine.executor.worker.runner.pool
        pool.data[np.flatnonzero(scheduler.blocks.free_mask)] = float("nan")  # what it held is gone
    outs = run(engine)
    assert outs["low"].error is None, outs["low"].error
    assert float(np.abs(outs["low"].images[0] - expected).max()) <= 1e-6


def test_a_controlled_request_is_a_result_cache_hit_only_with_the_same_images(sd_eps_path, controlnets):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=controlnets,
                             result_cache_mb=16)
    try:
        _result_cache_hits_and_misses(engine)
    finally:
        engine.shutdown()


def _result_cache_hits_and_misses(engine: DiffusionEngine) -> None:
    first = engine.generate(["a tree"], [params(seed=11)], use_tqdm=False)[0]
    again = engine.generate(["a tree"], [params(seed=11)], use_tqdm=False)[0]
    assert again.metrics.result_cache_hit and not first.metrics.result_cache_hit
    np.testing.assert_array_equal(again.images[0], first.images[0])
    other = engine.generate(["a tree"], [params(image_seed=3, seed=11)], use_tqdm=False)[0]
    weaker = P(**{**vars(params(seed=11)), "controls": [control("edges", control_image(1), scale=0.3)]})
    scaled = engine.generate(["a tree"], [weaker], use_tqdm=False)[0]
    for out in (other, scaled):
        assert not out.metrics.result_cache_hit
        assert float(np.abs(out.images[0] - first.images[0]).max()) > 1e-3


def test_a_control_image_the_pool_cannot_hold_is_refused(sd_eps_path, controlnets):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", controlnets=controlnets,
                             num_state_blocks=18)
    try:
        big = params(steps=1, height=32, width=32, n=2)
        plain = engine.generate(["x"], [P(**{**vars(big), "controls": None})], use_tqdm=False)[0]  # fits alone
        assert plain.error is None
        with pytest.raises(ValueError, match="state-pool blocks but the pool has 18"):  # not with its image
            engine.generate(["x"], [big], use_tqdm=False)
    finally:
        engine.shutdown()


class _Request:
    """What request_blocks reads of a request: one image, no CFG, two controls."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.params = P(n=1)
        self.latent_blocks, self.history_slots, self.input_blocks, self.cache_blocks, self.rows = 1, 0, 0, 0, 1
        self.private_blocks, self.cond_blocks, self.cond_keys = 1, 1, (b"prompt", None)
        self.control_keys, self.control_blocks = keys, 3
        self.cond_entry = self.uncond_entry = self.blocks = None
        self.control_entries = ()

    @property
    def shared_entries(self):
        return [e for e in (self.cond_entry, self.uncond_entry, *self.control_entries) if e is not None]


def test_admission_counts_a_repeated_image_once_and_frees_it_to_the_cache():
    blocks = BlockManager(20)
    first = _Request((b"img", b"img"))
    assert blocks_needed(blocks, first) == 1 + 1 + 3  # latents, the prompt, one copy of the image
    tables, filled = allocate_blocks(blocks, first)
    assert tables.controls[0] == tables.controls[1] and tables.write_controls == (True, False)
    assert len(filled) == 2  # the prompt's entry and the image's, which its step writes
    second = _Request((b"img",))
    assert blocks_needed(blocks, second) == 1  # its latents: the prompt and the image are live entries
    tables2, _ = allocate_blocks(blocks, second)
    assert tables2.controls[0] == tables.controls[0] and tables2.write_controls == (False,)
    free_blocks(blocks, first)
    free_blocks(blocks, second)
    assert blocks.num_used_blocks == 0 and blocks.num_cached_blocks == 1 + 3  # both stay cached for others


def test_a_groups_images_are_gathered_from_the_pool_and_kept_only_for_the_same_requests():
    """The planner keeps a group's gathered images while its members stay; a request that comes in the blocks
    another one left is another member (its image is gathered again, not taken for the old one's)."""
    from types import SimpleNamespace

    import torch

    from dvllm.controls import Control
    from dvllm.worker.controlnets import ControlPlanner
    from dvllm.worker.state_pool import StatePool
    from dvllm.worker.unet_controlnet import unet_request_kind

    pool = StatePool(8, 4 * 4 * 3, torch.float32, torch.device("cpu"))
    net = SimpleNamespace(config=SimpleNamespace(global_pool_conditions=False), dtype=torch.float32)

    def state(blocks: list[int], value: float) -> SimpleNamespace:
        pool.write([blocks], torch.full((1, 3, 4, 4), value))
        data = SimpleNamespace(controls=(Control("edges", None),), guidance_scale=1.0, height=4, width=4)
        return SimpleNamespace(data=data, step=0, plan=SimpleNamespace(num_steps=4), control_images=[None],
                               blocks=SimpleNamespace(controls=(tuple(blocks),)))

    class Rows:  # one row per request, no CFG
        def request_rows(self, request):
            return [request], []

    planner = ControlPlanner({"edges": net}, unet_request_kind)
    a, b = state([0], 1.0), state([1], 2.0)
    first = planner.plan([a, b], Rows(), pool).groups[0]
    assert first.inputs[:, 0, 0, 0].tolist() == [1.0, 2.0]
    assert planner.plan([a, b], Rows(), pool).groups[0].inputs is first.inputs  # kept
    c = state([1], 3.0)  # b left; c's image was written into the blocks b had
    again = planner.plan([a, c], Rows(), pool).groups[0]
    assert again.inputs[:, 0, 0, 0].tolist() == [1.0, 3.0]
