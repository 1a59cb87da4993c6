"""The command line's answers that come before any image: bad flags and prompts-file lines refused before
the model loads, help and --version, and what is answered before torch is even imported."""
from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from utils_cli import FAST, expect_usage_error, no_model_load, write_lines  # noqa: F401 (fixtures)

import dvllm
from dvllm.entrypoints.cli import check_model_name, main
from dvllm.entrypoints.generate_jobs import check_sampler
from dvllm.samplers.registry import SHORT_NAMES

# -- checked before the model loads ---------------------------------------------------------------

@pytest.mark.parametrize("flags,expected", [
    (["--size", "64X64"], "'64X64'"),
    (["--size", " 64x64"], "' 64x64'"),
    (["--size", "64x64 "], "'64x64 '"),
    (["--size", "\uff16\uff14x64"], "WIDTHxHEIGHT"),  # full-width digits
    (["--size", "64\u00d764"], "WIDTHxHEIGHT"),  # a multiplication sign
    (["--size", "64x"], "WIDTHxHEIGHT"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["-n", "0"], "-n must be >= 1"),
    (["--seed", "-3"], "--seed"),
    (["--guidance", "-1"], "--guidance"),
    (["--sampler", "eulr"], "did you mean 'euler'"),
    (["--sampler", "NotAScheduler"], "'NotAScheduler'"),
    (["--model", "tiny-shape"], "did you mean 'tiny-shapes'"),
    (["--model", "sdxl-turbo"], "did you mean"),
    (["--max-batch-size", "0"], "max_batch_size"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_flags_fail_before_the_model_loads(sd_eps_path, tmp_path, capsys, no_model_load,  # noqa: F811
                                               flags, expected):
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", sd_eps_path,
                             *FAST, *flags)
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_bad_prompts_file_line_fails_before_the_model_loads(sd_eps_path, tmp_path, capsys,
                                                            no_model_load):  # noqa: F811
    prompts = write_lines(tmp_path / "p.jsonl", ["fine", {"prompt": "x", "sampler": "dpm++"}])
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "o"),
                             "--model", sd_eps_path, *FAST)
    assert f"{prompts}:2:" in err and "'dpm++'" in err


def test_model_suggestions_only_for_bare_names(tmp_path):
    check_model_name(None)
    check_model_name("tiny-shapes")
    check_model_name("sdxl")
    check_model_name("someone/sdxl-turb")  # a Hub id: the loader asks the Hub
    (tmp_path / "tiny-shape").mkdir()
    check_model_name(str(tmp_path / "tiny-shape"))  # an existing path: the loader says what is wrong with it
    with pytest.raises(ValueError, match="did you mean 'sd15'"):
        check_model_name("sd1.5")
    with pytest.raises(ValueError) as e:
        check_model_name("completely-unrelated-zzz")
    assert "did you mean" not in str(e.value) and "tiny-shapes" in str(e.value)  # lists what exists


def test_samplers_known_by_short_name_or_diffusers_class():
    for name in [*SHORT_NAMES, "UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"]:
        check_sampler(name)
    for name in ["eulr", "UNet2DConditionModel", "__class__", 5]:
        with pytest.raises(ValueError, match="sampler"):
            check_sampler(name)


# -- help, --version -------------------------------------------------------------------------------

def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_states_each_default_once(capsys, command):
    text = _help(capsys, command)
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    assert len(options) > 30
    for option in options:
        described = re.sub(r"^-\S+( [A-Z_]+)?(, -\S+( [A-Z_]+)?)*", "", option)  # not the flag's own name
        assert described.lower().count("default") <= 1, option


def test_help_groups_and_sampler_list(capsys):
    serve = _help(capsys, "serve")
    assert serve.index("\nserver:\n") < serve.index("\n  --port PORT") < serve.index("\nengine:\n")
    assert serve.index("\n  --ssl-certfile") < serve.index("\nengine:\n")
    generate = " ".join(_help(capsys, "generate").split())  # argparse wraps lines
    for name in SHORT_NAMES:
        assert name in generate
    assert "flow_euler" in generate and "--log-level" in generate


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"{dvllm.__version__}\n"


# -- answers before torch -------------------------------------------------------------------------

_ARGV_CHECKED_BEFORE_TORCH = {
    "version": ["--version"],
    "help": ["--help"],
    "serve help": ["serve", "--help"],
    "unknown flag": ["serve", "--no-such-flag"],
    "bad port": ["serve", "--port", "70000"],
    "bad size": ["generate", "x", "--size", "5x5x"],
    "misspelt sampler": ["generate", "x", "--sampler", "eulr_a"],
    "bad engine flag": ["serve", "--max-batch-size", "0"],
}


@pytest.mark.parametrize("argv", list(_ARGV_CHECKED_BEFORE_TORCH.values()), ids=list(_ARGV_CHECKED_BEFORE_TORCH))
def test_the_command_answers_without_importing_torch_or_diffusers(argv):
    """`--help`, `--version` and a bad flag answer in a fraction of a second because nothing heavy is imported
    (importing torch and diffusers took 11 s on a loaded 2-core machine): checked by what was imported."""
    code = ("import sys\nfrom dvllm.entrypoints.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []", done.stdout + done.stderr


def test_a_port_in_use_is_refused_before_torch_is_imported():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = ("import sys\nfrom dvllm.entrypoints.cli import main\n"
                "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
                "print('HEAVY', 'torch' in sys.modules)")
        done = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(port)], capture_output=True,
                              text=True, timeout=120)
    assert "already in use" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "HEAVY False"
