#!/usr/bin/env bash
# Where the segfault of tests/test_state_ops.py comes from (H200, torch 2.11, 2026-12-04: twice, each time when one
# of dvllm's CPU ops raised its argument error after ~500 CUDA tests; never on the CPU machines, torch 2.11 or
# 2.13, with or without the CUDA kernels built, under ASan). Each case is its own process; rc=139 is a segfault.
# "aten" raises libtorch's own error: if that crashes too, the cause is the machine's, not dvllm's ops.
#   tests/gpu/kernel_errors.sh      (from the repo root; PYTHON picks the interpreter; ~2-4 min, +33 s build)
PY=${PYTHON:-python3}
export PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cat > /tmp/diag_case.py <<'PYEOF'
import sys, torch
from dvllm import _extension
case = sys.argv[1]
assert _extension.custom_ops_available("cuda" if "cuda" in case else "cpu")
ops = torch.ops.dvllm
if "cuda" in case:  # a CUDA context and our CUDA kernels first, as the earlier tests did
    p = torch.randn(64, 16, device="cuda"); t = torch.arange(8, dtype=torch.int32, device="cuda").view(4, 2)
    for _ in range(50):
        ops.scatter_blocks(ops.gather_blocks(torch.empty(4, 20, device="cuda"), p, t) or torch.zeros(4, 20, device="cuda"), p, t)
    torch.cuda.synchronize()
pool, out = torch.zeros(8, 16), torch.zeros(2, 20)
bad = torch.tensor([[0, 1], [2, 8]], dtype=torch.int32)
calls = {"aten": lambda: torch.empty(2).view(3),                 # an error thrown by libtorch itself
         "gather": lambda: ops.gather_blocks(out, pool, bad),
         "scatter": lambda: ops.scatter_blocks(out, pool, bad)}
for name in case.split("+")[1:]:
    for i in range(20):
        try:
            calls[name]()
        except RuntimeError:
            pass
    print(case, name, "raised 20x OK", flush=True)
PYEOF
for case in cpu+gather+scatter cpu+aten cuda+aten cuda+gather cuda+scatter cuda+aten+gather+scatter; do
  timeout 120 "$PY" /tmp/diag_case.py "$case" 2>&1 | grep -v "^W" | tail -4; echo "== $case rc=${PIPESTATUS[0]}"
done
# The crash's real history in one process: the CUDA kernel tests (~500), then the argument errors raised by
# dvllm's ops (tests/kernel_raises.py), then libtorch's own error. Each stage prints before it starts: the last
# "stage" line before rc=139 names the one that crashed (if only "aten" does, the fault is not dvllm's ops).
cat > /tmp/diag_history.py <<'PYEOF'
import sys, pytest, torch
sys.path.insert(0, "tests")
import kernel_raises
def stage(name):
    print("stage", name, flush=True)
stage("cuda kernel tests")
rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_state_ops.py", "-k",
                  "cuda and not check_their_arguments and not check_block_ids"])
print("cuda kernel tests: pytest exit", int(rc), flush=True)
for device in ("cuda", "cpu"):
    stage(f"dvllm's argument errors on {device}")
    for _ in range(20):
        kernel_raises.check_arguments(device)
stage("dvllm's block id errors (cpu)")
for _ in range(20):
    kernel_raises.check_block_ids()
stage("libtorch's own error")
for _ in range(20):
    try:
        torch.empty(2).view(3)
    except RuntimeError:
        pass
stage("all raised, no crash")
PYEOF
timeout 400 "$PY" /tmp/diag_history.py 2>&1 | grep -E "^(stage|cuda kernel|[0-9]+ passed|Fatal|  File)" | tail -30
echo "== history rc=${PIPESTATUS[0]}"
# The C frames of a crash (faulthandler shows Python frames only): the image has cuda-gdb, not gdb
debugger=$(command -v gdb || command -v cuda-gdb)
if [ -n "$debugger" ]; then
  timeout 180 "$debugger" -q -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" /tmp/diag_case.py cuda+gather+scatter 2>&1 | grep -v "^\[" | tail -80
else
  echo "no gdb or cuda-gdb"
fi
