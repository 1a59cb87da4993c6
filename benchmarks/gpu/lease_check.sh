#!/usr/bin/env bash
# What fits one lent GPU (15 minutes of device time, one call): run_suite.sh's most needed steps, each capped so
# that the whole ends inside --budget seconds (default 540), most needed first. Every step writes its own log and
# JSON under --out; a step that fails or runs out of time is reported and the next one runs.
#   0. the MLPerf Wan2.2 clip (issue 51): wan2.2-t2v-a14b-mlperf (dummy weights, bf16; both experts resident, about
#      83 GB with the decode by benchmarks/README.md's estimate: an H200) at MLPerf Inference v6.0's settings
#      (720x1280, 81 frames, 20 steps, CFG 4.0 / 3.0): one denoising step timed (1 warm-up, 2 timed, the request
#      then aborted) and the tiled decode of its 81 frames (dvllm.benchmarks.clip_step); prints the step time and,
#      labelled as arithmetic, 20 x the step + the decode beside MLPerf's published 21 s a video. The reference
#      state ops (DVLLM_USE_CUSTOM_OPS=0): no kernel build; the step is the 14B forward's
#   0a. Wan's host syncs on CUDA (tests/test_host_syncs.py -k "cuda_step and [wan": the bracket, as "allowance"
#      holds "wan"): Wan 2.1 and its I2V, with and without LoRA and each step cache, their rows on Wan's own UniPC
#      (vectorized in the fused update: no step of it may wait on the device)
#   0b. ControlNet per request (issue 52): sdxl (dummy weights, fp16) at 1024x1024, 4 requests with CFG, a step with
#      a dummy ControlNetModel of SDXL's UNet architecture acting on 2 of them against the same step without
#      (dvllm.benchmarks.control_step): the ratio is what the controls cost
#   1. MLPerf LoadGen (issue 49): sdxl (dummy weights, bf16) at MLPerf's settings (1024x1024, 20 Euler steps,
#      guidance 8.0), Offline then Server, short runs: their summaries' samples/s, queries/s and p99 beside MLPerf
#      v5.0's published 2.37 samples/s and 2.29 queries/s a GPU (8x H200, TensorRT). Needs mlcommons-loadgen in
#      .whl/ (cp312 manylinux wheel, as the others)
#   1a. the same in fast mode (issue 49, --fast: regional compile, graphs captured at start, the fastest attention)
#   1b. the LoRA trace (issue 49): sdxl (dummy weights, fp16) at 256-512 px, 16 requests of 0-3 random rank-16
#      adapters each (Zipf popularity over the trace's pool) at 1 and 4 requests/s: dvllm vs its request-level
#      policy vs the pipeline serially (set_adapters per request): goodput at 3x solo latency, p50/p99
#   1c. step caching under load (issue 49): flux-dev (dummy, bf16) at 256-512 px, 12 DiffusionDB-shaped requests
#      at 1 request/s: dvllm, dvllm with first_block (0.08) for every request, the request-level policy
#   1d. fast mode against exact (issue 49): flux-dev (bf16) on the images trace at 1/s and all at once; then the
#      image bound, exact then fast, at the default size (scripts/fast_mode_bound.py: the graphs' size)
#   2. video (issue 29): wan2.1-t2v-1.3b, the generated video trace (832x480, 480x832, 480x480, CFG or not) with
#      frames and steps clamped to 33 and 12, six clips at once: dvllm vs the pipeline serial and in static batches
#      (`dvllm bench run --generate video`); its engine builds the CUDA kernels (Hopper only,
#      TORCH_CUDA_ARCH_LIST=9.0) for the steps after it
#   2b. one long clip (33 frames, 12 steps) and three short ones (17 frames, 4 steps) sent just behind it: dvllm
#      (oldest first, the default), dvllm taking the shapes in turn (shape_order=turns), and serial
#   3. where the kernels' argument errors crashed the process on 2026-12-04 (tests/gpu/kernel_errors.sh: each
#      raise alone, then the suite's real history in one process: CUDA kernel tests, dvllm's raises, libtorch's)
#   4. CUDA graph replay against eager and the syncs in one step, per family (tests/test_host_syncs.py -k cuda)
#   5. the CUDA kernels' tests, tests/test_state_ops.py whole (passed 2026-12-04 but for the two argument-error
#      tests, which now raise in a process of their own: a crash there fails one test, not the step)
#   6. sd15 (fp16, the mixed workload at 256/512 px, all at once): dvllm vs serial vs static batches of 8 and 16
#   7. worker groups (issue 28): flux-dev's forward and its exchanges on this one GPU (measured 2026-12-04)
#
#   benchmarks/gpu/lease_check.sh [--out DIR] [--budget SECONDS] [--only STEP,STEP] [--dry-run]
#
# --only runs just the named steps (mlperf_clip, wan_sync, controlnet, loadgen, loadgen_fast, loras, cache,
# fast_flux, fast_bound, video, video_turns, kernel_errors, graphs, kernels, sd, group), in the order above.
#
# Wheels the machine lacks (diffusers and its small needs) travel in .whl/ as run_suite.sh says.
# --dry-run runs the same steps on the CPU at tiny sizes (the presets' CPU cousins).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-benchmarks/results} budget=540 dry=0 only=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --budget) budget=$2; shift ;;
    --dry-run) dry=1 ;;
    --only) only=,$2,; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
source benchmarks/gpu/machine_env.sh
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # Hopper only: half the build
python=${PYTHON:-python3}

# step NAME SHARE COMMAND...: runs COMMAND under `timeout` for SHARE seconds at most (less if the budget is short)
step() {
  local name=$1 share=$2 left=$((budget - SECONDS)); shift 2
  if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then return; fi
  local cap=$((share < left ? share : left))
  if [ "$cap" -lt 10 ]; then echo "== $name: skipped, the budget is spent"; failed="$failed $name(skipped)"; return; fi
  echo "== $name (at most ${cap} s; ${SECONDS} s used)"
  local start=$SECONDS
  timeout --kill-after=5 "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo ' (out of time)')"
  [ $rc = 0 ] || failed="$failed $name"
}
failed=

# behind_long FILE SIZE FRAMES STEPS SHORT_FRAMES SHORT_STEPS: a trace of one long clip, then three short ones
# 0.5 s apart just behind it (a pipeline runs them after the long clip's whole call)
behind_long() {
  local i
  {
    echo "{\"prompt\": \"a long clip\", \"size\": \"$2\", \"frames\": $3, \"steps\": $4, \"guidance\": 5.0, \"seed\": 0, \"arrival\": 0}"
    for i in 1 2 3; do
      echo "{\"prompt\": \"short clip $i\", \"size\": \"$2\", \"frames\": $5, \"steps\": $6, \"guidance\": 5.0, \"seed\": $i, \"arrival\": $((i * 5 / 10)).$((i * 5 % 10))}"
    done
  } >"$1"
}

$python - <<'PY'
import torch, diffusers, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), diffusers {diffusers.__version__}, "
      f"transformers {transformers.__version__}")
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY

if [ $dry = 1 ]; then
  step mlperf_clip 90 env DVLLM_USE_CUSTOM_OPS=0 $python -m dvllm.benchmarks.clip_step --dry-run --decode \
    --output-json "$out/mlperf_clip.json"
  step wan_sync 120 $python -m pytest -q -x tests/test_host_syncs.py -k "a_step_reads and [wan" \
    -p no:cacheprovider
  step controlnet 90 $python -m dvllm.benchmarks.control_step --dry-run --output-json "$out/controlnet.json"
  step loadgen 90 $python -m dvllm.entrypoints.cli bench loadgen --model tiny-sd --load-format dummy --device cpu \
    --dtype float32 --size 32x32 --steps 4 --num-samples 64 --scenario Offline --min-duration-s 5 \
    --offline-expected-qps 40 --output-dir "$out/loadgen" --output-json "$out/loadgen.json"
  step loadgen_fast 120 $python -m dvllm.entrypoints.cli bench loadgen --model tiny-sd --load-format dummy \
    --device cpu --dtype float32 --size 32x32 --steps 4 --num-samples 64 --scenario Offline --min-duration-s 5 \
    --offline-expected-qps 40 --fast --output-dir "$out/loadgen_fast" --output-json "$out/loadgen_fast.json"
  step loras 120 $python -m dvllm.entrypoints.cli bench run --model tiny-sd --load-format dummy --device cpu \
    --dtype float32 --generate loras --num 3 --rate 2 --size-divisor 8 --random-loras 4 --trace-seed 1 \
    --max-image-pixels 16384 --output-json "$out/loras.json"
  step cache 120 $python -m dvllm.entrypoints.cli bench run --model flux-cpu --load-format dummy --device cpu \
    --dtype float32 --generate images --num 3 --rate 2 --size-divisor 4 --trace-seed 1 --max-image-pixels 65536 \
    --contenders dvllm,cached,request --engine-variant cached:default_cache=first_block:threshold=0.08 \
    --output-json "$out/cache.json"
  step fast_flux 300 $python -m dvllm.entrypoints.cli bench run --model flux-cpu --load-format dummy --device cpu \
    --dtype float32 --generate images --num 3 --rate 2 --size-divisor 4 --trace-seed 1 --max-image-pixels 65536 \
    --contenders dvllm,fast --engine-variant fast:fast=true --output-json "$out/fast_flux.json"
  step fast_bound 300 $python scripts/fast_mode_bound.py --model flux-cpu --load-format dummy --device cpu --num 2 \
    --steps 2 --output-json "$out/fast_bound.json"
  step video 120 $python -m dvllm.entrypoints.cli bench run --model wan-cpu --load-format dummy --device cpu \
    --dtype float32 --generate video --num 3 --rate inf --size-divisor 26 --clamp-frames 9 --clamp-steps 3 \
    --contenders dvllm,serial,static --output-json "$out/video.json"
  behind_long "$out/behind_long.jsonl" 32x16 9 3 5 2
  step video_turns 120 $python -m dvllm.entrypoints.cli bench run --model wan-cpu --load-format dummy --device cpu \
    --dtype float32 --trace "$out/behind_long.jsonl" --contenders dvllm,turns,serial \
    --engine-variant turns:shape_order=turns --output-json "$out/video_turns.json"
  step group 60 $python -m dvllm.benchmarks.group_on_device --preset flux-cpu --size 128 --text-tokens 16 \
    --device cpu --dtype float32 --rounds 1 --out "$out/group_on_device.json"
  step sd 120 $python -m dvllm.entrypoints.cli bench run --model tiny-sd --load-format dummy --device cpu \
    --dtype float32 --generate mixed --num 4 --rate inf --size-divisor 32 --clamp-steps 3 \
    --contenders serial,static,dvllm --static-batch-size 2 --output-json "$out/sd15.json"
  step kernels 120 $python -m pytest -q -x tests/test_state_ops.py -k "cpu and dtype0" -p no:cacheprovider
  # CI runs the dry run (.ci/run): every step must pass there
  [ -z "$failed" ] || { echo "== dry run: failed:$failed"; exit 1; }
  echo "== dry run: every step passed in ${SECONDS} s"
  exit 0
fi
step mlperf_clip 330 env DVLLM_USE_CUSTOM_OPS=0 $python -m dvllm.benchmarks.clip_step --model wan2.2-t2v-a14b-mlperf \
  --device cuda --dtype bfloat16 --warmup 1 --timed 2 --decode --vae-tiling --output-json "$out/mlperf_clip.json"
step wan_sync 150 $python -m pytest -v --tb=short --maxfail=4 -p no:cacheprovider tests/test_host_syncs.py \
  -k "cuda_step and [wan"
step controlnet 120 $python -m dvllm.benchmarks.control_step --model sdxl --device cuda --dtype float16 --size 1024 \
  --rows 4 --controlled 2 --timed 3 --output-json "$out/controlnet.json"
# One engine, Offline then Server, 45 s each: Offline at an expected 2 samples/s; Server Poisson at 1.5 queries/s,
# p99 <= 20 s (too few queries for LoadGen's early stopping to vouch for a p99: that run may say INVALID for that
# alone, and says why)
step loadgen 200 $python -m dvllm.entrypoints.cli bench loadgen --model sdxl --load-format dummy --device cuda \
  --dtype bfloat16 --num-samples 500 --scenario Offline,Server --min-duration-s 45 --offline-expected-qps 2 \
  --server-target-qps 1.5 --output-dir "$out/loadgen" --output-json "$out/loadgen.json"
step loadgen_fast 200 $python -m dvllm.entrypoints.cli bench loadgen --model sdxl --load-format dummy --device cuda \
  --dtype bfloat16 --num-samples 500 --scenario Offline,Server --min-duration-s 45 --offline-expected-qps 2 \
  --server-target-qps 1.5 --fast --output-dir "$out/loadgen_fast" --output-json "$out/loadgen_fast.json"
step loras 200 $python -m dvllm.entrypoints.cli bench run --model sdxl --load-format dummy --device cuda \
  --dtype float16 --generate loras --num 16 --rate 1,4 --size-divisor 2 --random-loras 16 --max-loras 8 \
  --output-json "$out/loras.json"
step cache 200 $python -m dvllm.entrypoints.cli bench run --model flux-dev --load-format dummy --device cuda \
  --dtype bfloat16 --generate images --num 12 --rate 1 --size-divisor 2 --contenders dvllm,cached,request \
  --engine-variant cached:default_cache=first_block:threshold=0.08 --output-json "$out/cache.json"
step fast_flux 240 $python -m dvllm.entrypoints.cli bench run --model flux-dev --load-format dummy --device cuda \
  --dtype bfloat16 --generate images --num 12 --rate 1,inf --size-divisor 2 --max-batch-size 8 --max-decode-batch 2 \
  --contenders dvllm,fast --engine-variant fast:fast=true --output-json "$out/fast_flux.json"
step fast_bound 200 $python scripts/fast_mode_bound.py --model flux-dev --load-format dummy --device cuda \
  --dtype bfloat16 --num 4 --steps 8 --option max_batch_size=8 --option max_decode_batch=2 \
  --output-json "$out/fast_bound.json"
step video 280 $python -m dvllm.entrypoints.cli bench run --model wan2.1-t2v-1.3b --load-format dummy --device cuda \
  --dtype bfloat16 --generate video --num 6 --rate inf --clamp-frames 33 --clamp-steps 12 \
  --contenders dvllm,serial,static --output-json "$out/video.json"
behind_long "$out/behind_long.jsonl" 832x480 33 12 17 4
step video_turns 280 $python -m dvllm.entrypoints.cli bench run --model wan2.1-t2v-1.3b --load-format dummy \
  --device cuda --dtype bfloat16 --trace "$out/behind_long.jsonl" --contenders dvllm,turns,serial \
  --engine-variant turns:shape_order=turns --output-json "$out/video_turns.json"
step kernel_errors 240 env PYTHON=$python tests/gpu/kernel_errors.sh
step graphs 110 $python -m pytest -v --tb=short --maxfail=4 -p no:cacheprovider tests/test_host_syncs.py -k cuda
step kernels 120 env PYTHON=$python tests/gpu/run.sh
step sd 100 $python -m dvllm.entrypoints.cli bench run --model sd15 --load-format dummy --device cuda \
  --dtype float16 --generate mixed --num 16 --rate inf --size-divisor 2 --clamp-steps 25 \
  --contenders serial,static,dvllm --static-batch-size 8,16 --output-json "$out/sd15.json"
step group 40 $python -m dvllm.benchmarks.group_on_device --preset flux-dev --size 1024 --text-tokens 512 \
  --device cuda --dtype bfloat16 --rounds 5  # its JSON is in its log: 8 files come back from a lease at most
echo "== done in ${SECONDS} s"
