#!/usr/bin/env bash
# On a GPU machine, in an environment with a CUDA build of torch and dvllm installed
# (`pip install -e ".[test]"`): loads dvllm's custom ops with their CUDA kernels (the package's library when it
# has them, else a build just in time in a per-environment directory: docs/install.md) and runs the state-op
# tests on the CUDA path.
#
#   tests/gpu/run.sh                      # build + tests/test_state_ops.py
#   tests/gpu/run.sh --bench              # and the kernel benchmark on the GPU (fp16, fp32)
#   tests/gpu/run.sh tests/test_engine.py # more test files or pytest args, run alongside
#
# PYTHON picks the interpreter (default: python3). Exits non-zero if the CUDA kernels
# do not build, if any test fails, or if no CUDA test ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
report=$(mktemp -d)/state_ops.xml
bench=0
if [[ "${1:-}" == "--bench" ]]; then bench=1; shift; fi

echo "== environment"
"$PY" - <<'PY'
import shutil, torch
from torch.utils.cpp_extension import CUDA_HOME
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={CUDA_HOME}, nvcc={shutil.which('nvcc')}")
if not torch.cuda.is_available():
    raise SystemExit("FAIL: no CUDA GPU visible to torch")
print("GPU:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
PY

echo "== building dvllm's custom ops (first build compiles; later runs reuse the cache)"
"$PY" - <<'PY'
import logging, time
logging.basicConfig(level=logging.WARNING)
from dvllm._extension import custom_ops_available
start = time.perf_counter()
ok = custom_ops_available("cuda")
print(f"custom ops with CUDA kernels: {ok} ({time.perf_counter() - start:.1f} s)")
if not ok:
    raise SystemExit("FAIL: the CUDA kernels did not build (the error above says why)")
import torch
from dvllm.sampler_coeffs import layout
got = {"cpu": list(torch.ops.dvllm.coeff_layout()), "cuda": list(torch.ops.dvllm.cuda_coeff_layout())}
archs = list(torch.ops.dvllm.cuda_archs())
major, minor = torch.cuda.get_device_capability()
print(f"coefficient layout: {got} (sampler_coeffs.py: {layout()}); CUDA archs built: {archs}")
if any(v != layout() for v in got.values()):
    raise SystemExit("FAIL: a kernel library was compiled with another coefficient layout than sampler_coeffs.py")
if not any(a <= major * 100 + minor * 10 for a in archs):  # an older arch's cubin (same major) or PTX runs
    raise SystemExit(f"FAIL: nothing built for this GPU (sm_{major}{minor}) or older among {archs}")
PY

echo "== tests/test_state_ops.py $* (CPU and CUDA)"
status=0
"$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_state_ops.py "$@" --junitxml="$report" || status=$?

echo "== summary"
"$PY" - "$report" "$status" <<'PY'
import os
import sys
import xml.etree.ElementTree as ET
if not os.path.exists(sys.argv[1]):  # a crash (the 2026-12-04 H200 run: a segfault) leaves no report
    raise SystemExit(f"FAIL: pytest ended (exit {sys.argv[2]}) before writing its report: its output above says where")
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
counts = {}
for case in cases:
    where = "cuda" if "cuda" in case.get("name") else "other"
    outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    counts.setdefault(where, {}).setdefault(outcome, 0)
    counts[where][outcome] += 1
for where, by_outcome in sorted(counts.items()):
    print(f"{where:>5}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(by_outcome.items())))
cuda_passed = counts.get("cuda", {}).get("passed", 0)
if int(sys.argv[2]) != 0 or cuda_passed == 0:
    raise SystemExit(f"FAIL (pytest exit {sys.argv[2]}, {cuda_passed} CUDA tests passed)")
print(f"OK: {cuda_passed} CUDA tests passed")
PY

if [[ $bench == 1 ]]; then
  echo "== benchmark (cuda)"
  "$PY" benchmarks/kernels/benchmark_state_ops.py --device cuda --dtypes fp16,fp32
fi
