"""A new user's first commands (issue 48, items 8-12), run as they are typed: what start-up says while it
imports and loads, that nothing but dvllm's own lines reach stderr (in the CLI and in the Python API), flags
and model names refused at once with the command's usage and a suggestion, a server killed while it loads
taking its engine core process with it, and what a step cache skipped reported per image."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image
from process_tree import dvllm_processes
from utils_cli import assert_quiet, cli

from dvllm.logging_setup import quiet_libraries
from dvllm.models.model_names import check_model_name

DVLLM = str(Path(sys.executable).parent / "dvllm")  # the console script a user types
WAIT = 300.0  # s: bound for what only a broken build exceeds (a model load on a loaded 2-core machine)
# What the libraries print while a model loads, reproduced on this stack before it was quieted (issue 48, item 9)
NOISE = ["Failed to load", "register_constant", "torchvision", "Unable to import", "Loading pipeline components",
         "Loading weights", "config attributes", "Changing scheduler", "it/s]"]
NO_HUB = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": ""}  # the CI's offline switch, off where a test needs it


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _assert_no_noise(stderr: str) -> None:
    assert_quiet(stderr)
    for noise in NOISE:
        assert noise not in stderr, f"{noise!r} in stderr:\n{stderr}"


# -- items 8, 9 and 12: one `dvllm generate` with a step cache ---------------------------------------------

@pytest.fixture(scope="module")
def cached_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`dvllm generate` on the built-in DiT with TaylorSeer every other step: 6 steps, of which 3 and 5 are
    predicted (steps 0-2 always run)."""
    out = tmp_path_factory.mktemp("first-contact") / "circle.png"
    proc = subprocess.run([DVLLM, "generate", "a red circle", "--model", "tiny-shapes-dit", "-o", str(out),
                           "--steps", "6", "--seed", "1", "--cache", "taylorseer:cache_interval=2", "--no-progress"],
                          capture_output=True, text=True, timeout=WAIT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return proc, out


@pytest.mark.slow
def test_start_up_says_what_it_imports_and_loads(cached_run):
    lines = cached_run[0].stderr.splitlines()
    said = [next(i for i, line in enumerate(lines) if text in line)
            for text in ("loading torch and diffusers ...", "loading model tiny-shapes-dit on cpu ...",
                         "model tiny-shapes-dit loaded in")]
    assert said == sorted(said), lines  # in the order they happen


@pytest.mark.slow
def test_generate_prints_dvllm_lines_only(cached_run):
    _assert_no_noise(cached_run[0].stderr)


@pytest.mark.slow
def test_generate_reports_the_steps_the_cache_skipped(cached_run):
    proc, out = cached_run
    assert f"{out}  (seed 1, 6 steps, 2 skipped by the step cache)" in proc.stdout.splitlines()
    assert proc.stdout.strip().endswith("0 failed; the step cache skipped 2 of 6 steps")
    with Image.open(out) as image:
        parameters = json.loads(image.text["parameters"])
    assert parameters["cached_steps"] == 2 and parameters["cache"]["method"] == "taylorseer"


def test_a_video_carries_its_skipped_steps_in_its_mp4_tags(tmp_path):
    """What generate writes for a video model's request (the MP4 part of the run above, without the model)."""
    import av
    import numpy as np

    from dvllm.entrypoints.generate_output import ImageWriter
    from dvllm.sampling_params import SamplingParams
    from dvllm.step_cache import CacheConfig

    params = SamplingParams(num_inference_steps=6, width=16, height=16, num_frames=5, fps=8.0,
                            cache=CacheConfig("taylorseer", cache_interval=2))
    path = str(tmp_path / "v.mp4")
    ImageWriter(str(tmp_path), manifest=False, model="m").write("p", params, 1, [np.zeros((5, 16, 16, 3))], [path],
                                                                 cached_steps=2)
    with av.open(path) as container:
        tags = json.loads(container.metadata["comment"])
    assert tags["cached_steps"] == 2 and tags["cache"]["method"] == "taylorseer"


# -- item 9: the Python API --------------------------------------------------------------------------------

_API_SCRIPT = """
import logging
import diffusers.utils.logging as diffusers_logging
import transformers.utils.logging  # (sets its logger's level when first imported: before `state()` reads it)
from dvllm import DiffusionEngine, SamplingParams

def state():
    return [logging.getLogger(n).level for n in ("diffusers", "transformers", "torchao")] + [
        diffusers_logging.is_progress_bar_enabled()]

before = state()
engine = DiffusionEngine(device="cpu", decode_workers=1)  # (a process of dvllm's own, on the same stderr)
out = engine.generate("a red circle", SamplingParams(num_inference_steps=3, seed=1, sampler="euler"), use_tqdm=False)
print("OK", out[0].ok, "STATE", before == state())
"""


@pytest.mark.slow
def test_the_python_api_is_quiet_and_leaves_the_users_logging_as_it_was():
    """A script as a user writes it (README's): the default model's load, its decode worker's process and a request
    whose sampler is not the model's own (diffusers' scheduler-config notes) print nothing; the libraries' levels
    and bars are back after."""
    proc = subprocess.run([sys.executable, "-c", _API_SCRIPT], capture_output=True, text=True, timeout=WAIT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "OK True STATE True"
    _assert_no_noise(proc.stderr)


def test_quiet_libraries_keeps_what_the_user_set_and_restores_the_rest():
    import diffusers.utils.logging as diffusers_logging

    chosen, default = logging.getLogger("transformers"), logging.getLogger("diffusers")
    saved = chosen.level, default.level, diffusers_logging.is_progress_bar_enabled()
    chosen.setLevel(logging.INFO)  # the user asked for it: kept
    default.setLevel(logging.WARNING)
    diffusers_logging.enable_progress_bar()  # a user's default (whatever an earlier test in this process left)
    try:
        entered, left = threading.Event(), threading.Event()

        def other_call() -> None:  # a second dvllm call on another thread, overlapping the first
            with quiet_libraries():
                entered.set()
                left.wait(WAIT)

        thread = threading.Thread(target=other_call)
        with quiet_libraries():
            thread.start()
            assert entered.wait(WAIT)
            assert default.level == logging.ERROR and chosen.level == logging.INFO
            assert not diffusers_logging.is_progress_bar_enabled()
        assert default.level == logging.ERROR  # the other call still runs
        left.set()
        thread.join(WAIT)
        assert default.level == logging.WARNING and chosen.level == logging.INFO
        assert diffusers_logging.is_progress_bar_enabled()
    finally:
        chosen.setLevel(saved[0])
        default.setLevel(saved[1])
        (diffusers_logging.enable_progress_bar if saved[2] else diffusers_logging.disable_progress_bar)()


# -- item 10: flags and model names, answered before torch is imported ---------------------------------------

def _typed(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command as typed, with -X importtime: its stderr also lists every module it imported."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "dvllm.entrypoints.cli", *argv],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)


def _message(proc: subprocess.CompletedProcess) -> str:
    """stderr without importtime's lines; and no torch among those (a fraction of a second, not a minute)."""
    imported = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imported, "no -X importtime output: the check below would pass vacuously"
    assert not [line for line in imported if line.endswith(("| torch", "| diffusers"))], "torch was imported"
    return "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))


@pytest.mark.parametrize("argv,usage,suggestion", [
    (["serve", "--max-batch", "8"], "usage: dvllm serve", "did you mean --max-batch-size?"),  # no prefix match
    (["serve", "--max-batch-sze=8"], "usage: dvllm serve", "did you mean --max-batch-size?"),
    (["generate", "x", "--stepz", "3"], "usage: dvllm generate", "did you mean --steps?"),
    (["serve", "--bogus"], "usage: dvllm serve", None),  # nothing near it: no guess
])
def test_a_misspelt_flag_shows_the_commands_usage_and_the_flag_meant(argv, usage, suggestion):
    proc = _typed(*argv)
    err = _message(proc)
    assert proc.returncode == 2
    assert usage in err and "usage: dvllm [-h]" not in err
    assert err.strip().splitlines()[-1].startswith(f"dvllm {argv[0]}: error: unrecognized arguments: --")
    assert (suggestion in err) if suggestion else "did you mean" not in err


@pytest.mark.parametrize("model,expected", [
    ("./no/such/folder", "model path './no/such/folder' does not exist"),
    ("tiny-shape", "did you mean 'tiny-shapes'"),
    ("not a model/x", "is neither a local path nor a Hub id"),
])
def test_a_model_that_cannot_load_is_refused_before_torch(model, expected):
    proc = _typed("serve", "--model", model)
    assert proc.returncode == 2 and expected in _message(proc)


def test_an_offline_hub_id_missing_from_the_cache_says_how_to_run_offline(tmp_path):
    proc = _typed("generate", "x", "--model", "someone/some-model", "--download-dir", str(tmp_path),
                  env=_env(HF_HUB_OFFLINE="1"))
    err = _message(proc)
    assert proc.returncode == 2 and "'someone/some-model'" in err
    assert "HF_HUB_OFFLINE=1" in err and "local diffusers folder" in err and "hf download someone/some-model" in err


def test_an_offline_hub_id_in_the_cache_passes(tmp_path):
    snapshot = tmp_path / "models--someone--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text("{}")
    (tmp_path / "models--someone--some-model" / "refs").mkdir()
    (tmp_path / "models--someone--some-model" / "refs" / "main").write_text("abc123")
    check_model_name("someone/some-model", offline=True, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        check_model_name("someone/other-model", offline=True, cache_dir=str(tmp_path))
    check_model_name("someone/other-model", offline=False, cache_dir=str(tmp_path))  # online: the loader asks


# -- item 11: children die with their parent -------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _wait_for(predicate, what: str, timeout: float = WAIT):
    """Polls until predicate() is truthy and returns it; the bound is reached only when something is broken."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture
def hanging_hub():
    """A Hub endpoint that accepts connections and never answers: a core loading from it can never finish."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_server_stopped_while_loading_takes_its_core_process_with_it(hanging_hub, sig, tmp_path):
    """SIGTERM: the server stops its core and exits 143; SIGKILL (no handler runs): the core sees its parent go."""
    env = _env(**NO_HUB, HF_ENDPOINT=hanging_hub, HF_HUB_ETAG_TIMEOUT="600", HF_HUB_DOWNLOAD_TIMEOUT="600")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = cli("serve", "someone/some-model", "--port", str(port), "--device", "cpu", "--engine-core-process")
    log = tmp_path / "serve.log"  # (a file, not a pipe: an orphaned core would hold a pipe open)
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    cores: list[int] = []
    try:
        cores = _wait_for(lambda: dvllm_processes(server.pid, "dvllm-core"), "the engine core process")
        server.send_signal(sig)
        server.wait(WAIT)
        _wait_for(lambda: not _alive(cores[0]), "the core process to exit with its server", timeout=60)
    finally:
        server.kill()
        server.wait(WAIT)
        for pid in filter(_alive, cores):  # (the failure's orphan: not left to the next tests)
            os.kill(pid, signal.SIGKILL)
    output = log.read_text()
    assert "dvllm.startup: loading torch and diffusers ..." in output  # (item 8: said before the import)
    if sig == signal.SIGTERM:
        assert server.returncode == 143 and output.strip().endswith("dvllm serve: terminated"), output


@pytest.mark.parametrize("on_main_thread", [True, False], ids=["main-thread", "other-thread"])
def test_a_child_started_by_the_helper_dies_with_its_killed_parent(on_main_thread):
    """The mechanism every dvllm child uses (core, stage workers, group members): the kernel's parent-death
    signal when the parent's main thread started it (tied to the thread that forks, so never asked for from
    another, whose end would kill the child), the thread watching the parent's pid otherwise."""
    parent_code = (
        "import subprocess, sys, threading\n"
        "from dvllm.child_process import DEATH_SIGNAL_ENV, child_command, child_env\n"
        "def spawn():\n"
        "    env = child_env({'PYTHONUNBUFFERED': '1'})\n"
        "    child = subprocess.Popen(child_command('http.server', '--bind', '127.0.0.1', '0'), env=env,\n"
        "                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)\n"
        "    child.stdout.readline()  # 'Serving HTTP on ...': it runs its module, its parent watch set up\n"
        "    print(child.pid, env[DEATH_SIGNAL_ENV], flush=True)\n"
        f"if {on_main_thread}:\n    spawn()\n"
        "else:\n    thread = threading.Thread(target=spawn)\n    thread.start()\n    thread.join()\n"
        "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    child = None
    try:
        child, death_signal = parent.stdout.readline().split()
        assert death_signal == ("1" if on_main_thread else "0")
        assert _alive(int(child))  # (off the main thread: its spawning thread has ended, and it lives on)
        parent.kill()
        parent.wait(WAIT)
        _wait_for(lambda: not _alive(int(child)), "the child to exit with its parent", timeout=60)
    finally:
        parent.kill()
        parent.wait(WAIT)
        if child is not None and _alive(int(child)):  # (the failure's orphan: not left to the next tests)
            os.kill(int(child), signal.SIGKILL)
