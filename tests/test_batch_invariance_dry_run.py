"""batch_invariance's GPU check, exercised on the CPU with tiny-sd (its --dry-run)."""
import json

import pytest


@pytest.mark.slow
def test_batch_invariance_dry_run_measures_and_stresses(tmp_path, capsys):
    from dvllm.benchmarks import batch_invariance

    out = tmp_path / "invariance.json"
    batch_invariance.main(["--dry-run", "--output-json", str(out)])
    results = json.loads(out.read_text())
    (measured,) = results["invariance"]
    assert measured["dtype"] == "float32" and len(measured["per_request"]) == 8
    assert measured["max_abs_diff"] <= 1e-3  # on the CPU in float32 batching changes nothing
    stress = results["stress"]
    native = int(stress["native"].split("x")[0])
    assert stress["ok"] and stress["images"] >= 1 and stress["size"] == f"{2 * native}x{2 * native}"  # 4x the area
    assert "alone vs mixed batch of 8" in capsys.readouterr().out
