"""The built-in video model, tiny-shapes-video (scripts/train_tiny_shapes_video.py): it loads by its bare name,
its videos equal diffusers' WanPipeline's for the same seed, and it draws what it is asked, the motion too, read
back with plain image arithmetic (dvllm.tiny_shapes.reader.read_video) on held-out seeds."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from dvllm import DiffusionEngine, SamplingParams
from dvllm.models.loader import builtin_folder
from dvllm.tiny_shapes.meaning import HELD_OUT_SEED, evaluate, score, video_cases
from dvllm.tiny_shapes.reader import Reading, read_video
from dvllm.tiny_shapes.video import MOTIONS, NUM_FRAMES, VIDEO_SIZE, all_video_scenes, video_vocabulary

NAME = "tiny-shapes-video"
TOL = 1e-3
# Every 9th of the 128 held-out cases (15 videos, every colour, shape and motion). Over all 128 (seed 1000) the
# shipped weights read motion 96.9%, colour 65.6%, shape 37.5% (32 px frames blur the shape: its VAE alone reads
# colour 86%, shape 57% back from the training videos). An untrained model reads no motion, or a random one (about
# 1 in 4): the motion bound is what this test is for.
BOUNDS = {"colour": 0.4, "motion": 0.75}


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusionEngine]:
    engine = DiffusionEngine(model=NAME, device="cpu", dtype="float32", max_batch_size=16)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_the_builtin_folder_loads_by_name_with_its_defaults(engine):
    assert builtin_folder(NAME) is not None
    assert engine.loaded_model.name == NAME
    info = engine.model_info
    assert info.family == "wan" and info.video is not None
    assert (info.defaults.steps, info.defaults.height, info.defaults.width) == (20, VIDEO_SIZE, VIDEO_SIZE)
    assert (info.video.frames, info.video.fps) == (NUM_FRAMES, 8)  # its dvllm_defaults.json, not Wan's 81 at 16


@pytest.mark.slow
def test_videos_equal_diffusers_wan_pipeline(engine):
    pipe = WanPipeline.from_pretrained(builtin_folder(NAME), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    info = engine.model_info.defaults
    prompts = [("a red circle moving to the right", 7), ("a small blue star moving up", 8)]
    outs = engine.generate([p for p, _ in prompts],
                           [SamplingParams(seed=s, num_frames=NUM_FRAMES, output_type="np") for _, s in prompts],
                           use_tqdm=False)
    for (prompt, seed), out in zip(prompts, outs):
        assert out.error is None, out.error
        want = pipe(prompt, num_inference_steps=info.steps, guidance_scale=info.guidance, height=info.height,
                    width=info.width, num_frames=NUM_FRAMES, generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="np").frames[0]
        got = np.asarray(out.images[0])
        assert got.shape == want.shape == (NUM_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3)
        diff = float(np.abs(got - want).max())
        assert diff <= TOL, f"{prompt!r}: max abs diff {diff}"


@pytest.mark.slow
def test_it_draws_the_shape_moving_the_way_asked(engine, capsys):
    asked = video_cases()[::9]
    assert {c.motion for c in asked} == set(MOTIONS)
    scores, videos = evaluate(engine, asked, num_frames=NUM_FRAMES)
    with capsys.disabled():
        print(f"\n{NAME} on {len(videos)} held-out prompts: " + ", ".join(f"{k} {v:.0%}" for k, v in scores.items()))
    low = {name: (scores[name], bound) for name, bound in BOUNDS.items() if scores[name] < bound}
    assert not low, f"(share right, bound) {low}"


def test_video_cases_ask_every_colour_shape_and_motion_on_held_out_seeds():
    asked = video_cases()
    assert len(asked) == 128 and min(c.seed for c in asked) == HELD_OUT_SEED
    assert len({(c.colour, c.shape, c.motion) for c in asked}) == 128 and len({c.seed for c in asked}) == 128
    for case in asked:
        assert case.position is None and case.motion in case.prompt and case.colour in case.prompt


@pytest.mark.parametrize("size", [VIDEO_SIZE, 64])
def test_the_reader_reads_every_training_video_right(size):
    wrong = []
    for scene in all_video_scenes():
        reading = read_video(np.stack([np.asarray(frame) for frame in scene.render(size=size)]))
        if (reading.motion, reading.scene.colour, reading.scene.shape, reading.scene.size) != \
                (scene.motion, scene.color, scene.shape, scene.size) or not reading.scene.clean:
            wrong.append((scene, reading))
    assert not wrong, wrong[:5]


def test_a_still_or_empty_video_has_no_motion():
    scene = all_video_scenes()[0]
    still = np.stack([np.asarray(scene.render(size=VIDEO_SIZE)[4])] * NUM_FRAMES)
    assert read_video(still).motion is None
    assert read_video(np.ones((NUM_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3))).motion is None


def test_score_counts_motion_over_the_video_cases():
    asked = video_cases()[:4]
    readings = [Reading(c.colour, c.shape, c.size or "small", None, clean=True) for c in asked]
    scores = score(asked, readings, [c.motion for c in asked[:2]] + [None, "moving up"])
    assert "position" not in scores and scores["colour"] == 1.0
    assert scores["motion"] == sum(c.motion == m for c, m in zip(asked, [asked[0].motion, asked[1].motion, None,
                                                                         "moving up"])) / 4


def test_the_tokenizer_gives_each_caption_word_one_token():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{builtin_folder(NAME)}/tokenizer")
    for word in video_vocabulary():
        ids = tokenizer(word, add_special_tokens=True).input_ids
        assert len(ids) == 2 and ids[-1] == tokenizer.eos_token_id and ids[0] != tokenizer.unk_token_id, word
