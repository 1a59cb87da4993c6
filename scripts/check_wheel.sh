#!/usr/bin/env bash
# Installs dvllm as a user would and checks that it serves with the kernels in its wheel (.ci/run calls this).
#
# 1. `pip wheel` of a copy of the tree (what git tracks, plus files not ignored), with build isolation as
#    `pip install .` does: pyproject's build requirements (torch==2.13.0) in an environment of pip's own.
# 2. A fresh venv, outside the tree: torch==2.13.0, then the wheel with its dependencies.
# 3. From a directory outside the tree: `dvllm generate` on the built-in default model, writing an image; its
#    log must say the CPU kernels were loaded from the package (not built just in time, not the reference ops).
# 4. `dvllm serve` from there: one image through the HTTP API, and /v1/models says the kernels are the package's.
#
# PYTHON picks the interpreter that makes the venv (default: python3). KEEP=1 leaves the temp dir behind.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dvllm-wheel.XXXXXX")
[[ "${KEEP:-0}" == 1 ]] || trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
step() { echo "== check_wheel: $* ($((SECONDS - start)) s)"; }

step "copying the tree to $tmp/src"
mkdir "$tmp/src"
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
  xargs -0 cp --parents -t "$tmp/src")

step "building the wheel"
"$PY" -m venv "$tmp/build-venv"  # only its pip: the build itself runs in pip's isolated environment
"$tmp/build-venv/bin/pip" wheel -q --no-deps -w "$tmp/dist" "$tmp/src"
wheel=$(ls "$tmp"/dist/dvllm-*.whl)
step "built $(basename "$wheel")"

step "installing torch==2.13.0 and the wheel into a fresh venv"
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q torch==2.13.0
"$tmp/venv/bin/pip" install -q "$wheel"

step "dvllm generate, from $tmp/run"
mkdir "$tmp/run"
cd "$tmp/run"
"$tmp/venv/bin/dvllm" generate "a red circle" -o "$tmp/run/circle.png" --seed 0 --log-level info \
  >"$tmp/run/log" 2>&1 || { cat "$tmp/run/log"; echo "FAIL: dvllm generate failed" >&2; exit 1; }
[[ -s "$tmp/run/circle.png" ]] || { cat "$tmp/run/log"; echo "FAIL: no image written" >&2; exit 1; }
if ! grep -q "dvllm custom ops: cpu kernels, loaded from the package" "$tmp/run/log"; then
  cat "$tmp/run/log"
  echo "FAIL: the installed wheel did not load its CPU kernels from the package (see the log above)" >&2
  exit 1
fi
grep "dvllm custom ops" "$tmp/run/log"

step "dvllm serve, and one image through its HTTP API"
port=$("$tmp/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$tmp/venv/bin/dvllm" serve --port "$port" >"$tmp/run/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; [[ "${KEEP:-0}" == 1 ]] || rm -rf "$tmp"' EXIT
for _ in $(seq 600); do  # up to 10 minutes on a loaded machine; the log says why if it never comes up
  "$tmp/venv/bin/python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$tmp/run/serve.log"; echo "FAIL: dvllm serve exited" >&2; exit 1; }
  sleep 1
done
"$tmp/venv/bin/python" - "$port" <<'PY' || { cat "$tmp/run/serve.log"; echo "FAIL: no image from dvllm serve" >&2; exit 1; }
import base64, io, json, sys, urllib.request
from PIL import Image
body = json.dumps({"prompt": "a red circle", "seed": 0}).encode()
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/images/generations", body,
                                 {"Content-Type": "application/json"})
data = json.load(urllib.request.urlopen(request, timeout=300))["data"][0]
image = Image.open(io.BytesIO(base64.b64decode(data["b64_json"])))
models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=30))
ops = models["data"][0]["dvllm"]["custom_ops"]
print(f"served a {image.size[0]}x{image.size[1]} image; /v1/models custom_ops: {ops}")
assert ops["source"] == "package" and ops["kernels"] == ["cpu"], ops
PY
step "OK: the wheel generates and serves with its own kernels"
