#!/usr/bin/env bash
# The whole GPU check in one call (< 12 minutes on one H200): build the CUDA extension and run the
# CUDA kernel tests, then offline throughput of sd15 and sd-turbo against the pipeline serial and in static
# batches, then how far batching moves an image in fp16/bf16 and the largest step (dvllm.benchmarks.batch_invariance),
# then step caching on flux-dev and multi-LoRA on sdxl (the cache and loras traces), then the step loop's stalls
# (the stall trace with --forward-gaps: the decode stage off, on, and as CPU processes; the encode stage; async
# scheduling; sd15 at 512x512), then each family's preset loaded as served (dvllm.benchmarks.preset_load), then
# video: Wan 2.1 1.3B, the generated video trace (frames and steps clamped), dvllm vs serial vs static, then a
# worker group's costs on this one GPU: flux-dev's forward and its Ulysses exchanges, with the N-GPU arithmetic
# next to the peers' published scaling (group_on_device; issue 28's item 8). Every timed comparison is one
# `dvllm bench run`.
#
#   benchmarks/gpu/run_suite.sh [--dry-run] [--out DIR]
#
# The GPU machine has torch preinstalled and reaches no package registry. What it lacks
# (diffusers and its small pure-Python needs) travels as wheels in .whl/, fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       diffusers==0.42.1 importlib_metadata
# and installed below into /tmp/site. --dry-run runs the same steps on the CPU with tiny-sd.
set -euo pipefail
cd "$(dirname "$0")/../.."
dry=0 out=${OUT:-benchmarks/results}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
source benchmarks/gpu/machine_env.sh
python=${PYTHON:-python3}

bench="$python -m dvllm.entrypoints.cli bench run --load-format dummy"
if [ $dry = 1 ]; then
  echo "== dry run: CPU kernels and tiny-sd"
  $python -m pytest -q -x tests/test_state_ops.py -k "cpu and dtype0" -p no:cacheprovider | tail -2
  $bench --model tiny-sd --device cpu --dtype float32 --generate uniform --num 4 --rate inf --size-divisor 32 \
    --clamp-steps 3 --contenders serial,static,dvllm --static-batch-size 2,4 --output-json "$out/throughput_dry.json"
  $python -m dvllm.benchmarks.batch_invariance --dry-run --output-json "$out/batch_invariance_dry.json"
  $bench --model flux-cpu --device cpu --dtype float32 --generate cache --num 4 --rate inf --size-divisor 16 \
    --clamp-steps 4 --output-json "$out/step_cache_dry.json"
  $bench --model tiny-sd --device cpu --dtype float32 --generate loras --num 4 --rate inf --size-divisor 16 \
    --clamp-steps 2 --random-loras 4 --contenders dvllm,request,serial,static --output-json "$out/lora_dry.json"
  $bench --model tiny-sd --device cpu --dtype float32 --generate stall --num 8 --rate 4 --size-divisor 16 \
    --clamp-steps 8 --forward-gaps --engine-variant inloop:decode_stage=false \
    --engine-variant workers:decode_workers=1,encode_workers=1 --engine-variant async:async_scheduling=true \
    --contenders dvllm,inloop,workers,async --output-json "$out/stall_dry.json"
  $python -m dvllm.benchmarks.preset_load --dry-run --only tiny-sd --repeats 1 --output-json "$out/preset_load_dry.json"
  $bench --model wan-cpu --device cpu --dtype float32 \
    --generate video --num 3 --rate inf --size-divisor 26 --clamp-frames 9 --clamp-steps 3 \
    --contenders dvllm,serial,static --output-json "$out/video_dry.json"
  $python -m dvllm.benchmarks.group_on_device --preset flux-cpu --size 128 --text-tokens 16 --device cpu \
    --dtype float32 --rounds 1 --out "$out/group_on_device_dry.json"
else
  echo "== CUDA kernels: build and test"
  PYTHON=$python tests/gpu/run.sh 2>&1 | tail -15
  echo "== per family: syncs in one step (torch.cuda.set_sync_debug_mode), CUDA graph replay against eager"
  $python -m pytest -q -rfEs -p no:cacheprovider tests/test_host_syncs.py -k "cuda" 2>&1 | tail -15
  echo "== text encoders on the CPU, denoiser on CUDA (--encoder-device): the images of encoders on the GPU"
  $python -m pytest -q -rfEs -p no:cacheprovider tests/test_encoder_device.py -k "gpu" 2>&1 | tail -5
  echo "== offline throughput: all at once, the pipeline serial and in static batches of 4-32 against dvllm"
  for case in "sd15 25 7.5" "sd-turbo 1 0.0" "sd-turbo 4 0.0"; do
    set -- $case
    $bench --model "$1" --device cuda --dtype float16 --generate uniform --num 32 --rate inf --clamp-steps "$2" \
      --contenders serial,static,dvllm --static-batch-size 4,8,16,32 --warmup-rounds 1 --max-batch-size 64 \
      --output-json "$out/throughput_$1_$2.json" 2>&1 | tee "$out/throughput_$1_$2.txt"
  done
  echo "== batching in half precision (alone vs a mixed batch of 8), and 60 s at the largest size and batch"
  $python -m dvllm.benchmarks.batch_invariance --output-json "$out/batch_invariance.json" 2>&1 \
    | tee "$out/batch_invariance.txt"
  echo "== step caching: flux-dev (bf16), the cache trace, dvllm against the request-level policy and the cached pipeline"
  timeout 240 $bench --model flux-dev --device cuda --dtype bfloat16 --generate cache --num 16 --rate 1 \
    --clamp-steps 20 --size-divisor 2 --output-json "$out/step_cache.json" 2>&1 | tee "$out/step_cache.txt" \
    || echo "the cache trace stopped early"
  echo "== multi-LoRA: sdxl (fp16), the loras trace with rank-16 adapters, against request-level, serial and static"
  timeout 240 $bench --model sdxl --device cuda --dtype float16 --generate loras --num 16 --rate 1 --clamp-steps 8 \
    --random-loras 16 --contenders dvllm,request,serial,static --output-json "$out/lora.json" 2>&1 \
    | tee "$out/lora.txt" || echo "the loras trace stopped early"
  echo "== the step loop (sd15, 512x512): runners, then a burst of 12 new prompts (CFG) finishing together; gaps"
  echo "   between forwards with the decode stage off, on, as 2 CPU processes, the encode stage, async scheduling"
  timeout 300 $bench --model sd15 --device cuda --dtype float16 --generate stall --num 16 --rate 2 \
    --forward-gaps --engine-variant inloop:decode_stage=false \
    --engine-variant workers:decode_workers=2,decode_device=cpu,encode_workers=1,encode_device=cpu \
    --engine-variant async:async_scheduling=true --contenders dvllm,inloop,workers,async \
    --output-json "$out/stall.json" 2>&1 | tee "$out/stall.txt" || echo "the stall trace stopped early"
  echo "== each family's preset as served (family dtype; flux-dev int8 and fp8 with T5 on the CPU): weights, pool, step"
  timeout 420 $python -m dvllm.benchmarks.preset_load --output-json "$out/preset_load.json" 2>&1 \
    | tee "$out/preset_load.txt" || echo "preset_load stopped early (its JSON keeps what was measured)"
  echo "== video: wan2.1-t2v-1.3b (bf16, dummy weights), the generated video trace with 17-49 frames and at most 16"
  echo "   steps, eight clips at once: dvllm vs the pipeline serially vs static batches of equal shapes"
  timeout 540 $python -m dvllm.entrypoints.cli bench run --model wan2.1-t2v-1.3b --load-format dummy --device cuda \
    --dtype bfloat16 --generate video --num 8 --rate inf --clamp-frames 49 --clamp-steps 16 \
    --contenders dvllm,serial,static --output-json "$out/video.json" 2>&1 | tee "$out/video.txt" \
    || echo "the video trace stopped early"
  echo "== worker groups on one GPU: flux-dev (bf16, 1024x1024) forward, its exchanges as NCCL collectives, N-GPU arithmetic"
  timeout 120 $python -m dvllm.benchmarks.group_on_device --preset flux-dev --size 1024 --text-tokens 512 \
    --device cuda --dtype bfloat16 --out "$out/group_on_device.json" 2>&1 | tee "$out/group_on_device.txt" \
    || echo "group_on_device stopped early"
fi
