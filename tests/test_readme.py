"""The README's and docs' examples run as pasted (a newcomer's first try)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@pytest.mark.slow
def test_the_python_snippet_runs_as_pasted(tmp_path):
    section = (DOCS / "python.md").read_text().split("# Use it from Python", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "red.png").is_file()


@pytest.mark.slow
def test_the_command_line_examples_run_as_written(tmp_path):
    """The README's one `dvllm generate` example and docs/cli.md's block, pasted into a shell in an empty folder:
    no model to name, no file to make first (it failed on a size the built-in model refuses, after loading it)."""
    first = re.search(r"```bash\n(.*?)```", README.read_text().split("## Generate", 1)[1], re.DOTALL).group(1)
    assert first.startswith("dvllm generate ") and first.count("\n") == 1  # the README's one example
    section = (DOCS / "cli.md").read_text().split("# Use it from the command line", 1)[1]
    block = first + re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    bin_dir = str(Path(sys.executable).parent)  # the `dvllm` script of this environment
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out.png").is_file() and (tmp_path / "red.png").is_file()
    lines = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    by_prompt = {line["prompt"]: line for line in lines}  # (in the order they finished)
    assert sorted(by_prompt) == ["a blue square", "a red circle"]
    assert by_prompt["a blue square"]["num_inference_steps"] == 12 and by_prompt["a blue square"]["seed"] == 3
