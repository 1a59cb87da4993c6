"""The GPU suite's own code, exercised on the CPU with tiny-sd (its --dry-run)."""
import json

from dvllm.benchmarks import gpu_suite


def test_gpu_suite_dry_run_writes_its_table(tmp_path, capsys):
    out = tmp_path / "suite.json"
    gpu_suite.main(["--dry-run", "--output-json", str(out)])
    results = json.loads(out.read_text())
    assert len(results) == 4
    for result in results:
        assert set(result["images_per_s"]) >= {"serial", "dvllm"} and all(v > 0 for v in result["images_per_s"].values())
    assert "vs serial" in capsys.readouterr().out
