"""dvllm.benchmarks.clip_step, the lease's MLPerf step, in its dry run (wan-cpu, tiny, on the CPU): the steps after
the warm-up timed one by one, the decode timed, and the whole request labelled as arithmetic beside MLPerf's
published figure."""
from __future__ import annotations

import json

import pytest

from dvllm.benchmarks.clip_step import main


def test_the_dry_run_times_steps_and_the_decode_and_labels_the_arithmetic(tmp_path, capsys):
    out = tmp_path / "clip.json"
    result = main(["--dry-run", "--decode", "--timed", "3", "--output-json", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["model"], result["size"], result["frames"], result["cfg_rows"]) == ("wan-cpu", "32x32", 5, 2)
    assert len(result["step_s_each"]) == 3 and all(s > 0 for s in result["step_s_each"])
    assert result["decode_s"] > 0 and result["steps"] == 50  # wan-cpu's pipeline default: the request's own
    assert result["request_s_arithmetic"] == pytest.approx(50 * result["step_s"] + result["decode_s"], abs=0.02)
    printed = capsys.readouterr().out
    assert "arithmetic, not measured: 50 steps x" in printed and "published, for scale: MLPerf" in printed


@pytest.mark.parametrize("flags, message", [(["--warmup", "0"], "--warmup and --timed must be at least 1"),
                                            (["--warmup", "30", "--timed", "30"], "more steps than the request's 50")])
def test_more_steps_than_the_request_has_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        main(["--dry-run", *flags])
