#!/usr/bin/env bash
# The whole GPU check in one call (< 12 minutes on one H200): build the CUDA extension and run the
# CUDA kernel tests, then time sd15 and sd-turbo (dvllm bench throughput), then measure how far
# batching moves an image in fp16/bf16 and stress the largest step (dvllm.benchmarks.batch_invariance),
# then step caching on flux-dev (dvllm.benchmarks.cached, through throughput --cache), then multi-LoRA
# on sdxl: 8 adapters mixed in one batch and the step cost they add (dvllm.benchmarks.lora, throughput --loras),
# then the decode stage's loop stall (a thread, then decode processes on the CPU), the encode stage's (a burst
# of new prompts while a batch runs; a thread, then an encode process) and async scheduling off vs on
# (dvllm.benchmarks.loop_stall, encode_stall, async_scheduling, sd15 at 512x512),
# then each family's preset loaded as served, bf16/fp16 and quantized (dvllm.benchmarks.preset_load),
# then video: Wan 2.1 1.3B, the generated video trace (frames and steps clamped), dvllm vs serial vs static
# (dvllm bench run --generate video),
# then a worker group's costs on this one GPU: flux-dev's forward and its Ulysses exchanges, with the N-GPU
# arithmetic next to the peers' published scaling (group_on_device; issue 28's item 8).
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

if [ $dry = 1 ]; then
  echo "== dry run: CPU kernels and tiny-sd"
  $python -m pytest -q -x tests/test_state_ops.py -k "cpu and dtype0" -p no:cacheprovider | tail -2
  $python -m dvllm.benchmarks.throughput --model tiny-sd --device cpu --dtype float32 --size 16x16 --steps 3 \
    --num-requests 4 --rounds 1 --static-batch-sizes 2,4 --output-json "$out/throughput_dry.json"
  $python -m dvllm.benchmarks.batch_invariance --dry-run --output-json "$out/batch_invariance_dry.json"
  $python -m dvllm.benchmarks.throughput --model flux-cpu --device cpu --dtype float32 --size 32x32 --steps 4 \
    --num-requests 4 --workload mixed --cache taylorseer --rounds 1 --static-batch-sizes 2 --cost-rows 4 \
    --cost-rounds 1 --output-json "$out/step_cache_dry.json"
  $python -m dvllm.benchmarks.throughput --model tiny-sd --device cpu --dtype float32 --size 16x16 --steps 2 \
    --num-requests 4 --loras 2 --rounds 1 --cost-rows 4 --cost-rounds 1 --output-json "$out/lora_dry.json"
  $python -m dvllm.benchmarks.loop_stall --model tiny-sd --size 32 --cohort 4 --rounds 1 --output "$out/loop_stall_dry.json"
  $python -m dvllm.benchmarks.loop_stall --model tiny-sd --size 32 --cohort 4 --rounds 1 --decode-workers 1 \
    --output "$out/loop_stall_workers_dry.json"
  $python -m dvllm.benchmarks.encode_stall --model tiny-sd --size 32 --burst 4 --rounds 1 --encode-workers 1 \
    --output "$out/encode_stall_dry.json"
  $python -m dvllm.benchmarks.async_scheduling --model tiny-sd --size 32 --requests 6 --steps 2 --max-batch-size 4 \
    --rounds 1 --output "$out/async_scheduling_dry.json"
  $python -m dvllm.benchmarks.preset_load --dry-run --only tiny-sd --repeats 1 --output-json "$out/preset_load_dry.json"
  $python -m dvllm.entrypoints.cli bench run --model wan-cpu --load-format dummy --device cpu --dtype float32 \
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
  echo "== timing"
  for case in "sd15 25 7.5" "sd-turbo 1 0.0" "sd-turbo 4 0.0"; do
    set -- $case
    $python -m dvllm.benchmarks.throughput --model "$1" --load-format dummy --device cuda --dtype float16 \
      --size 512x512 --steps "$2" --guidance "$3" --num-requests 32 --rounds 1 --static-batch-sizes 4,8,16,32 \
      --output-json "$out/throughput_$1_$2.json" 2>&1 | tee "$out/throughput_$1_$2.txt"
  done
  echo "== batching in half precision (alone vs a mixed batch of 8), and 60 s at the largest size and batch"
  $python -m dvllm.benchmarks.batch_invariance --output-json "$out/batch_invariance.json" 2>&1 \
    | tee "$out/batch_invariance.txt"
  echo "== step caching: flux-dev (bf16, 512x512, mixed steps), dvllm with/without first_block against the cached pipeline"
  $python -m dvllm.benchmarks.throughput --model flux-dev --load-format dummy --device cuda --dtype bfloat16 \
    --size 512x512 --steps 20 --guidance 3.5 --num-requests 8 --workload mixed \
    --cache first_block:threshold=0.08 --rounds 1 --static-batch-sizes 4,8 \
    --output-json "$out/step_cache.json" 2>&1 | tee "$out/step_cache.txt"
  echo "== multi-LoRA: sdxl (fp16, 1024x1024, 4 steps), 8 rank-16 adapters in one batch against no LoRA, the pipeline"
  echo "   switching adapters per request and batching per adapter; step cost of 16 rows with 8 adapters"
  $python -m dvllm.benchmarks.throughput --model sdxl --load-format dummy --device cuda --dtype float16 \
    --size 1024x1024 --steps 4 --guidance 5.0 --num-requests 8 --loras 8 --rounds 1 --cost-rows 16 \
    --cost-rounds 3 --output-json "$out/lora.json" 2>&1 | tee "$out/lora.txt"
  echo "== decode stage: the loop's longest gap when 16 requests finish together, on vs off (sd15, 512x512)"
  timeout 240 $python -m dvllm.benchmarks.loop_stall --model sd15 --size 512 --cohort 16 --device cuda \
    --output "$out/loop_stall.json" 2>&1 | tee "$out/loop_stall.txt" || echo "loop_stall stopped early"
  echo "== decode workers: the same with 2 decode processes on the CPU (the GPU runs no VAE), 8 finishing together"
  timeout 120 $python -m dvllm.benchmarks.loop_stall --model sd15 --size 512 --cohort 8 --rounds 1 --device cuda \
    --decode-workers 2 --decode-device cpu --output "$out/loop_stall_workers.json" 2>&1 \
    | tee "$out/loop_stall_workers.txt" || echo "loop_stall with decode workers stopped early"
  echo "== encode stage: the loop's longest gap when 16 requests with new prompts (CFG) arrive while one runs, off vs"
  echo "   on (a thread) vs on with an encode process on the CPU (the GPU holds no text encoder)"
  timeout 180 $python -m dvllm.benchmarks.encode_stall --model sd15 --size 512 --burst 16 --rounds 2 --device cuda \
    --encode-workers 1 --encode-device cpu --output "$out/encode_stall.json" 2>&1 | tee "$out/encode_stall.txt" || echo "encode_stall stopped early"
  echo "== async scheduling: 32 small requests (8 steps, 8 rows a forward, progress outputs), off vs on (sd15, 512x512)"
  timeout 180 $python -m dvllm.benchmarks.async_scheduling --model sd15 --size 512 --requests 32 --steps 8 \
    --max-batch-size 8 --device cuda --output "$out/async_scheduling.json" 2>&1 | tee "$out/async_scheduling.txt" \
    || echo "async_scheduling stopped early (or its images differ)"
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
