"""`dvllm generate`, run in-process through dvllm.entrypoints.cli.main on the tiny saved pipeline,
plus one run of the installed console script."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from utils_cli import FAST, assert_quiet, cli, expect_usage_error, restore_logging, write_lines  # noqa: F401 (fixtures)

from dvllm import DiffusionEngine, SamplingParams
from dvllm.entrypoints.cli import main


def generate(model: str, *args: str) -> int:
    return main(["generate", *args, "--model", model, *FAST])


def pixels(path: Path | str) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# -- one prompt --------------------------------------------------------------------------------

def test_single_prompt_writes_png_and_summary(sd_eps_path, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert generate(sd_eps_path, "a red circle", "-o", str(out), "--seed", "1") == 0
    with Image.open(out) as image:
        assert (image.format, image.size, image.mode) == ("PNG", (16, 16), "RGB")
    stdout = capsys.readouterr().out
    assert f"{out}  (seed 1, 3 steps)" in stdout
    assert "1 image in" in stdout and "images/s" in stdout and "0 failed" in stdout
    # The PNG says what made it; a single prompt writes no manifest.
    with Image.open(out) as image:
        assert image.text["prompt"] == "a red circle"
        parameters = json.loads(image.text["parameters"])
    # under the names HTTP takes, and the sampler that ran (the model's own: none was asked for)
    assert {k: parameters[k] for k in ("prompt", "seed", "index", "num_inference_steps", "size", "n", "sampler")} == \
        {"prompt": "a red circle", "seed": 1, "index": 0, "num_inference_steps": 3, "size": "16x16", "n": 1,
         "sampler": DiffusionEngine(model=sd_eps_path).model_info.schedule.config["_class_name"]}
    assert not (tmp_path / "manifest.jsonl").exists()


def test_n_images_get_numbered_files(sd_eps_path, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert generate(sd_eps_path, "a red circle", "-o", str(out), "-n", "2", "--seed", "3") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-0.png", "out-1.png"]
    # Two images of one request come from one generator, one after the other: they must differ.
    assert not np.array_equal(pixels(tmp_path / "out-0.png"), pixels(tmp_path / "out-1.png"))
    assert "2 images in" in capsys.readouterr().out


# -- --prompts-file ----------------------------------------------------------------------------

@pytest.mark.slow
def test_prompts_file_plain_and_jsonl_lines(sd_eps_path, tmp_path, capsys):
    out_dir = tmp_path / "images"
    named = tmp_path / "elsewhere" / "named.png"  # absolute "output": used as given
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        "a plain line",
        "",  # blank lines are skipped and take no index
        {"prompt": "fewer steps, wide", "steps": 2, "seed": 7, "size": "24x16"},
        {"prompt": "two of them", "n": 2, "seed": 8},
        {"prompt": "named file", "seed": 9, "output": str(named)},
        {"prompt": "no guidance", "guidance": 1.0, "sampler": "euler", "seed": 10, "negative_prompt": "blurry"},
    ])
    # --seed is the default for lines without one, so every image here is reproducible.
    assert generate(sd_eps_path, "--prompts-file", str(prompts), "--output-dir", str(out_dir), "--seed", "5") == 0
    files = {
        0: [out_dir / "00000-5.png"],
        1: [out_dir / "00001-7.png"],
        2: [out_dir / "00002-8-0.png", out_dir / "00002-8-1.png"],
        3: [named],
        4: [out_dir / "00004-10.png"],
    }
    images_in_dir = [p for paths in files.values() for p in paths if p.parent == out_dir]
    assert sorted(out_dir.iterdir()) == sorted([*images_in_dir, out_dir / "manifest.jsonl"])
    assert named.is_file()
    with Image.open(files[1][0]) as image:
        assert image.size == (24, 16)  # WxH
    stdout = capsys.readouterr().out
    assert "(seed 7, 2 steps)" in stdout and "(seed 10, 3 steps)" in stdout
    assert "6 images in" in stdout

    # The same requests through the Python API give the same pixels: the file's parameters were read right.
    p = dict(num_inference_steps=3, height=16, width=16)
    requests = [
        ("a plain line", SamplingParams(**p, seed=5)),
        ("fewer steps, wide", SamplingParams(**{**p, "num_inference_steps": 2, "width": 24}, seed=7)),
        ("two of them", SamplingParams(**p, seed=8, n=2)),
        ("named file", SamplingParams(**p, seed=9)),
        ("no guidance", SamplingParams(**p, seed=10, guidance_scale=1.0, sampler="euler", negative_prompt="blurry")),
    ]
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    outs = engine.generate([q for q, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    for index, out in enumerate(outs):
        assert out.error is None and len(out.images) == len(files[index])
        for image, path in zip(out.images, files[index]):
            np.testing.assert_array_equal(pixels(path), np.asarray(image), err_msg=str(path))


@pytest.mark.slow
def test_cli_seed_gives_the_engines_image(sd_eps_path, tmp_path):
    out = tmp_path / "seeded.png"
    args = ["--seed", "42", "--guidance", "4.0", "--sampler", "dpmpp_2m", "--negative-prompt", "dark"]
    assert generate(sd_eps_path, "a blue square", "-o", str(out), *args) == 0
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    params = SamplingParams(num_inference_steps=3, height=16, width=16, seed=42, guidance_scale=4.0,
                            sampler="dpmpp_2m", negative_prompt="dark")
    same = engine.generate("a blue square", params, use_tqdm=False)[0]
    np.testing.assert_array_equal(pixels(out), np.asarray(same.images[0]))
    # ...and the comparison can fail: another seed is another image.
    other = engine.generate("a blue square", SamplingParams(**{**params.__dict__, "seed": 43}), use_tqdm=False)[0]
    assert not np.array_equal(pixels(out), np.asarray(other.images[0]))


# -- bad input: exit code 2 and a message --------------------------------------------------------

def test_bad_size(sd_eps_path, tmp_path, capsys):
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", sd_eps_path,
                             *FAST, "--size", "16by16")
    assert "'16by16'" in err and "WIDTHxHEIGHT" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("lines,expected", [
    (["a fine plain line", '{"prompt": "broken", "steps": 3'], [":2:", "not valid JSON"]),
    ([{"prompt": "typo", "stepz": 3}], [":1:", "stepz"]),
    ([{"steps": 3}], [":1:", "'prompt'"]),
    ([{"prompt": "zero steps", "steps": 0}], [":1:", "num_inference_steps", "got 0"]),
    ([{"prompt": "bad seed", "seed": -1}], [":1:", "seed"]),
    ([{"prompt": "bad size", "size": "big"}], [":1:", "'big'"]),
    (["", "   "], ["holds no prompts"]),
], ids=["not-json", "unknown-key", "no-prompt", "zero-steps", "negative-seed", "bad-size", "empty"])
def test_bad_prompts_file(sd_eps_path, tmp_path, capsys, lines, expected):
    prompts = write_lines(tmp_path / "prompts.jsonl", lines)
    out_dir = tmp_path / "out"
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(prompts), "--output-dir", str(out_dir),
                             "--model", sd_eps_path, *FAST)
    for text in expected:
        text = str(prompts) + text if text.startswith(":") else text  # "file:line"
        assert text in err, err
    assert not out_dir.exists()  # checked before any image is made


def test_unknown_sampler(sd_eps_path, tmp_path, capsys):
    # Found only when the engine resolves the request (it needs the model's scheduler), still exit 2.
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", sd_eps_path,
                             *FAST, "--sampler", "bogus_sampler")
    assert "sampler" in err and "'bogus_sampler'" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,expected", [
    ([], "give a prompt or --prompts-file"),
    (["x", "--max-batch-size", "0"], "max_batch_size"),
    (["x", "--dtype", "float64"], "dtype"),
])
def test_bad_command_line(sd_eps_path, capsys, argv, expected):
    err = expect_usage_error(capsys, "generate", *argv, "--model", sd_eps_path, "--no-progress")
    assert expected in err


# -- JSONL edge cases ---------------------------------------------------------------------------

@pytest.mark.parametrize("record,stdout_has,size", [
    ({"num_inference_steps": 2}, "2 steps)", (16, 16)),
    ({"height": 24, "width": 32}, "3 steps)", (32, 24)),
], ids=["num_inference_steps", "height-width"])
def test_jsonl_long_names_beat_cli_defaults(sd_eps_path, tmp_path, capsys, record, stdout_has, size):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "seed": 1, **record}])
    assert generate(sd_eps_path, "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "o")) == 0
    assert stdout_has in capsys.readouterr().out
    with Image.open(tmp_path / "o" / "00000-1.png") as image:
        assert image.size == size


def test_jsonl_numeric_size_is_a_usage_error(sd_eps_path, tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "size": 16}])
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(prompts), "--output-dir", str(tmp_path),
                             "--model", sd_eps_path, *FAST)
    assert ":1:" in err and "size" in err


def test_jsonl_non_string_output_is_a_usage_error(sd_eps_path, tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "output": 5}])
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(prompts), "--output-dir", str(tmp_path),
                             "--model", sd_eps_path, *FAST)
    assert ":1:" in err and "output" in err


def test_jsonl_relative_output_goes_to_output_dir(sd_eps_path, tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # a cwd-relative write would land here, not in the repo
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "output": "named.png"}])
    assert generate(sd_eps_path, "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "out")) == 0
    assert (tmp_path / "out" / "named.png").is_file() and not (tmp_path / "cwd" / "named.png").exists()


def test_prompts_file_writes_a_manifest_and_png_metadata(sd_eps_path, tmp_path):
    out_dir = tmp_path / "out"
    prompts = write_lines(tmp_path / "p.jsonl", [
        "a plain line",
        {"prompt": "two of them", "n": 2, "seed": 8, "guidance": 2.5, "sampler": "euler", "negative_prompt": "dark",
         "size": "24x16"},
    ])
    assert generate(sd_eps_path, "--prompts-file", str(prompts), "--output-dir", str(out_dir), "--seed", "5") == 0
    lines = [json.loads(line) for line in (out_dir / "manifest.jsonl").read_text().splitlines()]
    by_file = {line.pop("file"): line for line in lines}
    assert sorted(by_file) == ["00000-5.png", "00001-8-0.png", "00001-8-1.png"]  # relative to --output-dir
    model = by_file["00000-5.png"].pop("model")
    assert isinstance(model, str) and model
    default_sampler = by_file["00000-5.png"].pop("sampler")
    assert default_sampler.endswith("Scheduler")  # the model's own, named: a manifest says what ran
    assert by_file["00000-5.png"] == {"prompt": "a plain line", "seed": 5, "index": 0, "num_inference_steps": 3,
                                      "guidance_scale": 7.5, "size": "16x16", "negative_prompt": None, "n": 1}
    by_file["00000-5.png"]["sampler"] = default_sampler
    for k in (0, 1):
        assert by_file[f"00001-8-{k}.png"] == {
            "prompt": "two of them", "seed": 8, "index": k, "num_inference_steps": 3, "guidance_scale": 2.5,
            "size": "24x16",
            "sampler": "euler", "negative_prompt": "dark", "n": 2, "model": model}
    for name, record in by_file.items():  # each PNG carries the same record
        with Image.open(out_dir / name) as image:
            assert image.text["prompt"] == record["prompt"]
            assert json.loads(image.text["parameters"]) == {**record, "model": model}


def test_progress_bar_counts_denoising_steps(sd_eps_path, tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", ["three steps", {"prompt": "two steps", "steps": 2}])
    argv = ["generate", "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "o"), "--model", sd_eps_path,
            *[a for a in FAST if a != "--no-progress"]]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Generating" in err and "5/5" in err and "step" in err  # 3 + 2 steps, not 2 requests
    assert "2/2" not in err and "req" not in err


def test_admission_is_bounded_by_max_num_waiting(sd_eps_path, tmp_path, monkeypatch):
    seen: list[int] = []
    add_processed = DiffusionEngine.add_processed

    def spy(self, *args, **kwargs):
        seen.append(self.stats()["num_waiting"])
        return add_processed(self, *args, **kwargs)
    monkeypatch.setattr(DiffusionEngine, "add_processed", spy)
    prompts = write_lines(tmp_path / "p.txt", ["one", "two", "three", "four"])
    assert generate(sd_eps_path, "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "o"),
                    "--max-num-waiting", "1") == 0
    assert seen == [0, 0, 0, 0]  # each added only once the one before had left the waiting queue
    assert len(list((tmp_path / "o").glob("*.png"))) == 4


# -- quiet start-up, Ctrl-C: the real command in a subprocess ------------------------------------------

@pytest.mark.slow
def test_generate_start_up_is_quiet(sd_eps_path, tmp_path):
    out = tmp_path / "x.png"
    proc = subprocess.run(cli("generate", "x", "-o", str(out), "--model", sd_eps_path, "--device", "cpu", "--dtype",
                              "float32", "--steps", "3", "--size", "16x16"),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert_quiet(proc.stderr)
    assert "3/3" in proc.stderr  # what stderr does show: the bar, by step
    assert out.is_file()


def test_log_level_debug_brings_the_libraries_back(sd_eps_path, tmp_path, capfd):
    assert generate(sd_eps_path, "x", "-o", str(tmp_path / "x.png"), "--log-level", "debug") == 0
    assert "Loading pipeline components" in capfd.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_at_the_next_step_and_keeps_finished_images(sd_eps_path, tmp_path):
    out_dir = tmp_path / "out"
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "quick", "steps": 2, "seed": 1},
                                                 {"prompt": "endless", "steps": 900, "seed": 2}])
    proc = subprocess.Popen(cli("generate", "--prompts-file", str(prompts), "--output-dir", str(out_dir), "--model",
                                sd_eps_path, "--device", "cpu", "--dtype", "float32", "--size", "16x16",
                                "--no-progress"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        with ThreadPoolExecutor(1) as pool:  # the first image's line, however long the model takes to load
            first = pool.submit(proc.stdout.readline).result(timeout=300)
        assert first.startswith(str(out_dir / "00000-1.png")), first
        proc.send_signal(signal.SIGINT)  # "endless" has ~900 steps to go: it cannot finish first
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "interrupted: 1 of 2 images written"
    assert stdout == ""  # no summary line after the first image
    assert sorted(p.name for p in out_dir.iterdir()) == ["00000-1.png", "manifest.jsonl"]
    assert [json.loads(line)["prompt"] for line in (out_dir / "manifest.jsonl").read_text().splitlines()] == ["quick"]


# -- the installed console script --------------------------------------------------------------

@pytest.mark.slow
def test_console_script_default_model(tmp_path):
    script = Path(sys.executable).parent / "dvllm"
    assert script.is_file(), f"no console script at {script}: is dvllm installed (pip install -e .)?"
    out = tmp_path / "x.png"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the default preset needs no network; make sure of it
    proc = subprocess.run([str(script), "generate", "a red circle", "-o", str(out), "--steps", "2", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with Image.open(out) as image:
        assert image.size == (64, 64)  # tiny-shapes' default size
    assert "1 image in" in proc.stdout
