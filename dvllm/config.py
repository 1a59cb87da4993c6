"""EngineConfig: every engine knob, as one flat set of arguments.

The Python API (`DiffusionEngine(**kwargs)`) and the CLI flags are both generated
from this dataclass, so they cannot drift apart. The packages own what the fields mean: each resolves its part
into a small config of its own, checked there (core/scheduler_config.py, worker/pool_config.py,
worker/stage_config.py, parallel/parallel_config.py, models/load_config.py, ...); engine/configs.py resolves
them all once at start. What no one package owns is checked here (config_checks.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dvllm.config_checks import check_config, parse_named_paths
from dvllm.ip_adapters import check_ip_adapter_config
from dvllm.param_defaults import DEFAULT_PIXELS_FACTOR

CPU_STATE_POOL_MB = 1024  # the state pool off CUDA, where no memory profile sizes it

# A stage process's call bounds (stage_process.CallBounds): vLLM's execute-model timeout for a batch; a process's
# start (imports, its model copy, its first batch's warm-up) twice that
STAGE_CALL_TIMEOUT_S = 300.0
STAGE_START_TIMEOUT_S = 600.0


@dataclass
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "Local diffusers folder, Hub id or built-in preset (default: the built-in tiny model)."},
    )
    load_format: str = field(
        default="auto",
        metadata={"help": "'auto' loads weights; 'dummy' builds the architecture with random weights."},
    )
    dtype: str = field(default="auto", metadata={
        "help": "auto | float32 | float16 | bfloat16. auto: float32 on the CPU; on a GPU the family's half precision "
                "(bfloat16 for the DiT families: Flux, SD3, Qwen-Image, Z-Image and the edit models; float16 for "
                "SD and SDXL), logged at start."})
    vae_dtype: str = field(default="auto", metadata={
        "help": "The VAE's own dtype: auto | float32 | float16 | bfloat16. auto: dtype's, except a VAE whose config "
                "asks for float32 decoding (force_upcast, SDXL's) runs in float32 under float16; float32 avoids a "
                "half-precision VAE's overflow whatever its config says."})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N."})
    encoder_device: str | None = field(
        default=None,
        metadata={"help": "Run the text encoders on another device: cpu | cuda | cuda:N (their weights and "
                          "activations leave the denoiser's GPU: the memory profile gives that room to the pool; "
                          "none: the worker's device)."})
    base_model: str | None = field(
        default=None,
        metadata={"help": "For a single-file --model (.safetensors or .gguf): the diffusers folder or Hub id whose "
                          "pipeline it belongs to (configs, tokenizers and the weights the file lacks). A whole SD "
                          "1.x/2.x/SDXL checkpoint needs none: its kind's diffusers repo supplies the configs."})
    vae: str | None = field(
        default=None,
        metadata={"help": "A VAE in place of the model's own: a .safetensors file, a diffusers folder or a Hub id "
                          "(e.g. madebyollin/sdxl-vae-fp16-fix)."})
    revision: str | None = field(
        default=None, metadata={"help": "The model's Hub branch, tag or commit (default: main)."})
    variant: str | None = field(
        default=None,
        metadata={"help": "Load this variant's weight files only, e.g. fp16 (*.fp16.safetensors): the other "
                          "weights are never fetched."})
    download_dir: str | None = field(
        default=None, metadata={"help": "Hub cache to read and fill (default: huggingface_hub's, $HF_HOME)."})
    local_files_only: bool = field(
        default=False, metadata={"help": "Never reach the Hub: load what the cache or folder holds, or fail."})
    attention_backend: str | None = field(
        default=None,
        metadata={"help": "diffusers' attention backend for the denoiser: native, flash, _flash_3, sage, xformers, "
                          "_native_cudnn, ... (refused at start when not installed; UNets take native or "
                          "xformers; default: the model's own, torch SDPA; under fast, the fastest installed: "
                          "_flash_3 on Hopper, else flash, for a DiT that attends without masks in half "
                          "precision, native otherwise)."})
    vae_tiling: bool = field(
        default=False,
        metadata={"help": "Decode (and encode) images in overlapping tiles, as diffusers' enable_vae_tiling: large "
                          "sizes on small GPUs, at a small cost in seams and time; the memory profile measures the "
                          "decode so."})
    vae_tile_size: int | None = field(
        default=None,
        metadata={"help": "With vae_tiling or max_decode_mb, a tile's side in pixels (a multiple of the VAE's scale "
                          "factor, 8 for SD, SDXL, SD3, Flux, Z-Image, Wan 2.1); tiles overlap by a quarter. Smaller "
                          "tiles bound the decode's memory tighter and give a worker group more tiles to share out. "
                          "Unset: the VAE's own (its sample_size, 1024 for Flux: a 1024x1024 image is one tile; "
                          "256 for Wan). AutoencoderKL's VAEs and Wan's."})
    quantization: Any = field(
        default=None,
        metadata={"help": "Quantize weights as they load, through diffusers' PipelineQuantizationConfig: "
                          "BACKEND[:OPTION] for the denoiser: torchao:int8wo, torchao:int8dq, torchao:float8wo (FP8 "
                          "weights), torchao:float8dq (FP8 dynamic, CUDA 8.9+), torchao:int4wo (CUDA), "
                          "bitsandbytes:4bit|nf4|8bit (CUDA), quanto:int8|float8|int4|int2; or JSON {\"backend\": "
                          "..., \"options\": {...}, \"components\": [...]} for the backend's own options and other "
                          "components. LoRA serving takes torchao and quanto; load_format dummy and presets, torchao."})
    dummy_weight_seed: int = field(
        default=0, metadata={"help": "Seed of load_format='dummy' weights (images use each request's seed)."}
    )
    max_batch_size: int = field(default=16, metadata={"help": "Denoiser rows per forward (CFG requests count twice)."})
    max_running_pixels: int | None = field(
        default=None,
        metadata={"help": "The most pixels running at once over all shapes (each request's rows x frames x height x "
                          "width): admission waits, in order, while one more would pass it; a request alone always "
                          "runs; with scheduling_policy=priority an urgent request preempts less urgent ones to fit. "
                          "Where one request fills the GPU (large DiTs, video), running more only shares its "
                          "steps: each finishes later and none sooner. Default: bounded only by max_batch_size and "
                          "memory."})
    max_num_waiting: int = field(default=1024, metadata={"help": "Requests allowed to wait for admission."})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs | priority (lower value first)."})
    batching: str = field(
        default="step",
        metadata={"help": "step: requests join and leave the denoiser's batch at every step (dvllm's). request: the "
                          "request-level policy other servers run by default, for comparisons on the same kernels: "
                          "what waits when the running batch ends is batched by equal shape and parameters (one "
                          "LoRA set a batch; a step-cached request alone) and runs to completion, nothing joining "
                          "it and nothing preempted."})
    request_batch_wait_s: float = field(
        default=0.0,
        metadata={"help": "batching=request: how long a batch's first request waits for more of its kind, while the "
                          "batch has rows to spare (the window of request-level servers). 0: it starts at once."})
    shape_order: str = field(
        default="auto",
        metadata={"help": "Which shape group takes the next step (batching=step). oldest: the one holding the most "
                          "urgent (earliest) request, so shapes run one after another, later requests of the "
                          "running shape joining it. turns: the one whose request waited longest since its last "
                          "step, so shapes share the device: a short request is not held behind a long one, but "
                          "every request finishes later (benchmarks/README.md measures both). auto: oldest, but "
                          "turns under group_policy=elastic, whose deadline pace assumes it."})
    max_inference_steps: int = field(
        default=1000,
        metadata={"help": "Largest num_inference_steps accepted; a sampler that cannot run that many is refused "
                          "with the most it can run."},
    )
    max_image_pixels: int | None = field(
        default=None,
        metadata={"help": "Largest height*width accepted (images and img2img uploads). "
                          f"Default: {DEFAULT_PIXELS_FACTOR}x the model's native area (video models: their native "
                          "area, per frame)."},
    )
    max_images_per_prompt: int = field(default=8, metadata={"help": "Largest n accepted."})
    max_num_frames: int = field(
        default=129,
        metadata={"help": "Video models: the most frames one video may have (num_frames), past Wan 2.2's 121. "
                          "A video's latents and its forward grow with its frames; max_image_pixels bounds each "
                          "frame."})
    max_prompt_chars: int = field(
        default=10000,
        metadata={"help": "Longest prompt or negative_prompt accepted, in characters. Every text encoder "
                          "truncates far earlier (CLIP 77 tokens, T5 512); this bounds what one request may "
                          "make the engine tokenize and keep."},
    )
    max_prompt_chars_per_step: int | None = field(
        default=None,
        metadata={"help": "Characters of new prompts tokenized per engine step (new requests beyond it wait "
                          "for the next step; one is always admitted). Default: 2 * max_prompt_chars."},
    )
    max_input_images_per_step: int = field(
        default=4,
        metadata={"help": "Input images (image-to-image, inpainting, edits) encoded per engine step as their "
                          "requests are admitted (a VAE encode each, and the VL encoder for edit models); "
                          "new requests beyond it wait for the next step; one is always admitted."},
    )
    default_cache: Any = field(
        default=None,
        metadata={"help": "Step cache for requests that name none, e.g. first_block:threshold=0.08, "
                          "taylorseer:cache_interval=4, mag:mag_ratios=flux or teacache:rel_l1_thresh=0.4 (the "
                          "methods' fields: docs/step_cache.md); none by default."},
    )
    default_params: Any = field(
        default=None,
        metadata={"help": "What requests that set none get, over the model's own, as JSON: num_inference_steps, "
                          "guidance_scale, height, width, sampler, max_sequence_length, e.g. "
                          "'{\"num_inference_steps\": 8, \"guidance_scale\": 0}' (default: the model's: its "
                          "pipeline's, a known Turbo-kind model's card's, its folder's JSON file)."},
    )
    enable_lora: bool = field(
        default=False,
        metadata={"help": "Serve LoRA adapters (SamplingParams.loras, load_lora); on whenever lora_modules is "
                          "given."},
    )
    lora_modules: Any = field(
        default=None,
        metadata={"help": "LoRA adapters to load at start, as name=path (a folder or .safetensors file in "
                          "diffusers' LoRA format).", "nargs": "+"},
    )
    controlnets: Any = field(
        default=None,
        metadata={"help": "ControlNets to load at start, as name=path (a diffusers ControlNetModel folder or Hub id), "
                          "in the denoiser's dtype; requests name them in `controls` (SD 1.x/2.x and SDXL). "
                          "--controlnet NAME=PATH, repeated, says the same.",
                  "nargs": "+", "aliases": ("--controlnet",), "repeatable": True},
    )
    ip_adapter: str | None = field(
        default=None,
        metadata={"help": "An IP-Adapter to load at start through diffusers' load_ip_adapter: its weights file, "
                          "local or on the Hub as OWNER/REPO/[SUBFOLDER/]FILE (h94/IP-Adapter/models/"
                          "ip-adapter_sd15.safetensors); requests give image prompts in ip_adapter_image "
                          "(SD 1.x/2.x and SDXL)."},
    )
    ip_adapter_image_encoder: str | None = field(
        default=None,
        metadata={"help": "The IP-Adapter's CLIP image encoder (a CLIPVisionModelWithProjection folder, local or "
                          "on the Hub as OWNER/REPO[/SUBFOLDER]); default: the image_encoder folder beside the "
                          "weights, as load_ip_adapter reads it."},
    )
    max_loras: int = field(
        default=4, metadata={"help": "LoRA adapters resident per worker at once (slots); a request may use this "
                                     "many together."}
    )
    max_lora_rank: int = field(default=64, metadata={"help": "Largest LoRA rank accepted (slots are this wide)."})
    max_cpu_loras: int | None = field(
        default=None,
        metadata={"help": "Loaded adapters kept read in host memory; others are read again when a request names "
                          "them. Default: 2 * max_loras."},
    )
    max_lora_file_mb: float = field(
        default=2048.0,
        metadata={"help": "Largest LoRA weights file read (MB); a larger one is refused before it is read."},
    )
    allow_lora_bin: bool = field(
        default=False,
        metadata={"help": "Also read LoRA adapters from .bin files (pickles, read with torch.load's weights_only); "
                          "by default only .safetensors files."},
    )
    allow_lora_hub_ids: bool = field(
        default=False,
        metadata={"help": "Let a LoRA path that is no local file or folder name a Hugging Face Hub repo "
                          "(owner/name), fetched when loaded; by default adapter paths are local only."},
    )
    max_guidance_scale: float = field(default=100.0, metadata={"help": "Largest guidance_scale accepted."})
    sampler_plan_cache_size: int = field(default=256, metadata={"help": "Sampler schedules kept per (sampler, steps)."})
    state_pool_mb: float | None = field(
        default=None,
        metadata={"help": "Memory for request state (latents, sampler history, prompt embeddings). "
                          "Default: on CUDA a gpu_memory_utilization share of what the model leaves free; "
                          f"on the CPU {CPU_STATE_POOL_MB} MB."},
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Share of GPU memory dvllm may use in all (model, activations, state pool)."}
    )
    max_decode_batch: int = field(
        default=4,
        metadata={"help": "Most images one VAE decode call takes (finishers decode in chunks of this many): "
                          "bounds the decode's memory, which the GPU pool sizing counts."},
    )
    max_decode_mb: float | None = field(
        default=None,
        metadata={"help": "The memory one VAE decode call may take (MiB): a request whose untiled decode is "
                          "estimated above it decodes in tiles (its VAE's enable_tiling, that request only; its "
                          "output says so, and the GPU memory profile measures the worst decode so). The estimate "
                          "is linear in the pixels decoded, from one decode measured at start. Unset: every "
                          "decode untiled (or all tiled with vae_tiling)."},
    )
    decode_stage: bool | None = field(
        default=None,
        metadata={"help": "Decode finished images and previews on a thread of the worker's own (a CUDA stream of "
                          "its own), so the denoise loop never waits for a VAE decode; the GPU memory profile "
                          "reserves its VAE beside the loop's work. Unset (auto): on, unless on a GPU that "
                          "reservation would leave the state pool less than half of what it has without it "
                          "(start-up logs the choice). --no-decode-stage: the loop decodes."},
    )
    max_decode_queue: int = field(
        default=32,
        metadata={"help": "Most images handed to the decode stage and not yet decoded; past it the loop decodes "
                          "what finishes itself (backpressure: nothing is refused or lost)."},
    )
    decode_workers: int = field(
        default=0,
        metadata={"help": "Processes of their own that decode for the decode stage, each with a copy of the VAE on "
                          "--decode-device: the VAE and the conversion to images leave the worker's process (its "
                          "GIL) and, on GPUs, its device. 0: the stage's thread decodes in the worker's process. A "
                          "process that dies is started again and its images decoded anew: none is lost."},
    )
    decode_device: str | None = field(
        default=None,
        metadata={"help": "Where the decode workers run: cpu | cuda:N, or several comma-separated (the workers "
                          "placed on them in turn). Unset: the worker's device; a GPU worker's decode workers must "
                          "be on another device."},
    )
    encode_stage: bool | None = field(
        default=None,
        metadata={"help": "Encode the texts of waiting requests on a thread of the worker's own (a CUDA stream of its "
                          "own) while the batch runs, and admit a request once they are ready, so the denoise loop "
                          "never waits for a text encoder (with nothing running, admission encodes at once); an "
                          "edit model's prompts go with the images its encoder reads, and requests with input "
                          "images have their VAE encode made there too. Texts with text LoRA adapters stay with "
                          "admission. "
                          "The GPU memory profile reserves the encoders' work beside the loop's. Unset: on with "
                          "--encode-workers, else off."},
    )
    encode_workers: int = field(
        default=0,
        metadata={"help": "Processes of their own that encode the encode stage's texts, each with a copy of the text "
                          "encoders and tokenizers on --encode-device: they leave the worker's process (its GIL) and "
                          "device, and the worker frees its own encoders' weights (every text then waits for the "
                          "stage, even with nothing running; text LoRA adapters cannot be served). 0: the stage's "
                          "thread encodes in the worker's process. A process that dies is started again and its "
                          "texts encoded anew: none is lost."},
    )
    encode_device: str | None = field(
        default=None,
        metadata={"help": "Where the encode workers run: cpu | cuda:N, or several comma-separated (placed on them in "
                          "turn). Unset: the CPU."},
    )
    max_encode_ahead: int = field(
        default=32,
        metadata={"help": "Most items (texts, input-image starts) the encode stage holds queued or ready at once (the "
                          "rest wait their turn)."},
    )
    async_scheduling: bool = field(
        default=False,
        metadata={"help": "Schedule the next step while this one runs: the in-process worker steps on a thread of "
                          "its own with up to two steps queued, and a Ray worker gets its next step submitted behind "
                          "the one it runs, so no worker waits for the scheduler's bookkeeping (or, with Ray, the "
                          "round trip). Outputs, and a request's failure, come one step later."},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Processes that run each denoiser forward together (a worker group): the worker and "
                          "this many minus one members of its own, each with a copy of the denoiser on a device of "
                          "its own and a slice of every row's tokens (diffusers' context parallelism: transformers "
                          "it has a plan for, Flux and Qwen-Image among dvllm's). The worker alone holds the "
                          "requests' state; a member lost is started again and the forward run again. With "
                          "cfg_parallel_size C too, the group is C row groups of this many processes each. LoRA "
                          "rows are split too; a forward with step-cached rows runs on the worker alone. Not with "
                          "compile or cuda_graph."},
    )
    cfg_parallel_size: int = field(
        default=1,
        metadata={"help": "Row groups that split each denoiser forward's rows (a worker group, as "
                          "sequence_parallel_size's): a CFG request's conditional and unconditional rows run on "
                          "two, a larger batch is cut in contiguous slices, and the worker gathers the outputs. With "
                          "sequence_parallel_size S too, each row group is S processes that split its rows' tokens "
                          "(S x this many in all). Any family; as sequence_parallel_size's for LoRA, step caching, "
                          "compile and cuda_graph."},
    )
    ring_degree: int = field(
        default=1,
        metadata={"help": "How a group splits attention: 1, Ulysses (an all-to-all trades tokens for heads; the "
                          "group's size must divide the heads); sequence_parallel_size, Ring (key/value chunks "
                          "passed around; needs a GPU attention that returns its log-sum-exp)."},
    )
    group_devices: str | None = field(
        default=None,
        metadata={"help": "Where a group's members run, comma-separated, one each. Unset: a CPU worker's on the CPU, "
                          "a GPU worker's on the GPUs after its own."},
    )
    group_policy: str = field(
        default="static",
        metadata={"help": "static: a group splits every forward one way (tokens with sequence_parallel_size, rows "
                          "with cfg_parallel_size, both on a mesh with both). elastic (with sequence_parallel_size, "
                          "cfg_parallel_size 1): each step's forward is "
                          "split by rows when every process gets as many rows, or at least two, and by tokens "
                          "otherwise (a lone request spread over the group); and a request that would miss its "
                          "deadline (deadline_s) at the current step time runs in steps of its own, ahead of the "
                          "rest, until it would not. docs/design.md, 'Worker groups', states the rule."},
    )
    group_decode: bool = field(
        default=True,
        metadata={"help": "A worker group also decodes together: the VAE decoder's calls of a decode (its tiles "
                          "with --vae-tiling, else its images) are shared out across the group, each member holding "
                          "a copy of the decoder, and the tiles blended by diffusers as on one worker. Forwards wait "
                          "while the group decodes. AutoencoderKL's VAEs (not Qwen-Image's); not with decode "
                          "workers, which decode in processes of their own."},
    )
    group_timeout_s: float = field(
        default=300.0,
        metadata={"help": "A collective of the group (a forward's exchange, its forming) that waits this long fails "
                          "(a member hung): the group is formed anew and the forward runs again."},
    )
    stage_call_timeout_s: float = field(
        default=STAGE_CALL_TIMEOUT_S,
        metadata={"help": "An encode or decode worker process that leaves a batch unanswered this long (stopped, "
                          "wedged, deadlocked) is killed and started again, and its batch redone, as one that dies "
                          "is. A process's first batches, until it has answered one, have stage_start_timeout_s "
                          "instead. Raise it for slow batches (CPU decode workers of large videos). A group "
                          "member's calls have group_timeout_s."})
    stage_start_timeout_s: float = field(
        default=STAGE_START_TIMEOUT_S,
        metadata={"help": "The bound of a stage process's (encode or decode worker, group member) calls until it "
                          "has answered one: its start imports torch, builds its copy of the model and warms up. "
                          "Past it the process is killed and started again."})
    core_heartbeat_timeout_s: float = field(
        default=120.0,
        metadata={"help": "The async engine's core answers a ping between two steps; one that has answered nothing "
                          "this long (a frozen or wedged process, a step stuck) turns /health to 503 and new "
                          "requests are refused with 503 until it answers again; accepted requests keep waiting "
                          "(bounded by --request-timeout). It must exceed the longest single step (tens of seconds "
                          "for a large video model on one GPU, more on a first step that compiles)."})
    engine_core_process: bool | None = field(
        default=None,
        metadata={"help": "Run the async engine's core (scheduler, workers, decode stage) in a process of its own, "
                          "so that HTTP parsing, JSON, base64 and PIL in the server never hold the step loop's "
                          "GIL; requests and outputs cross a pipe. Unset: on for dvllm serve, off for "
                          "AsyncDiffusionEngine in Python. DiffusionEngine always steps in the caller's process."},
    )
    result_cache_mb: int = field(
        default=0,
        metadata={"help": "Host memory (MB) for the exact result cache: a seeded request identical to one already "
                          "served (model, adapters, prompt, seed, parameters, input images) gets that request's "
                          "images at once, without a step; least recently used out first. 0: off."},
    )
    max_cuda_graphs: int = field(
        default=16, metadata={"help": "Most CUDA graphs kept captured (least recently used out first)."}
    )
    num_state_blocks: int | None = field(
        default=None, metadata={"help": "Override the state pool's block count (testing, tuning)."}
    )
    enable_prompt_cache: bool = field(
        default=True, metadata={"help": "Share and keep identical prompt embeddings in the state pool."}
    )
    fast: bool = field(
        default=False,
        metadata={"help": "Fast mode: the settings below left unset are chosen for speed, once at start, and logged "
                          "in one line: compile regional; on CUDA, cuda_graph on with the graphs captured at start "
                          "(warm_up); the fastest attention backend installed for the device and denoiser; "
                          "channels_last for a UNet. FP8 only where asked (--quantization torchao:float8dq). LoRA "
                          "and step-cached rows are served, by the uncompiled blocks. Images move within float "
                          "rounding of the exact mode's (docs/options.md). Not with a worker group."})
    compile: str | None = field(
        default=None,
        metadata={"help": "torch.compile the denoiser: off | regional (each repeated block, diffusers' "
                          "_repeated_blocks, compiled once per block class: a short compile; a forward with LoRA "
                          "or step-cached rows runs the blocks uncompiled) | dynamic (the whole forward, one graph "
                          "for any batch) | bucketed (batches padded up to 1, 2, 4, 8, then multiples of 8 rows, "
                          "one graph each). Unset: off, or regional under fast."},
    )
    compile_backend: str | None = field(
        default=None,
        metadata={"help": "torch.compile's backend with compile on: inductor (the default: generated kernels) | "
                          "aot_eager | eager (no code generation: dynamo's tracing alone, to tell a compile "
                          "problem from a tracing one, and fast to start)."},
    )
    cuda_graph: bool | None = field(
        default=None,
        metadata={"help": "Capture the denoiser forward as a CUDA graph per bucketed batch size and replay it "
                          "(CUDA only; rows are padded to the bucket and discarded). Unset: off, or on under fast "
                          "where the device is CUDA."},
    )
    warm_up: bool | None = field(
        default=None,
        metadata={"help": "Run the denoiser at start on the model's default size: with cuda_graph, capture a graph "
                          "for every batch bucket then, and none while serving (a forward of another shape, or "
                          "with LoRA rows, runs without a graph); else compile it for one and two rows. Unset: on "
                          "under fast; off otherwise (graphs captured on a shape's first forward, compiles on "
                          "the first forwards)."},
    )
    channels_last: bool | None = field(
        default=None,
        metadata={"help": "A UNet denoiser's weights in channels-last memory format (the convolutions' fast "
                          "layout on GPUs); transformers have no convolutions to speak of and are left as they "
                          "are. Unset: on under fast."},
    )
    profile_steps: bool = field(
        default=False,
        metadata={"help": "Time each step's phases (schedule, gather, forward, ...); synchronizes the device."},
    )
    priority_aging_iterations: int = field(
        default=100,
        metadata={"help": "With scheduling_policy=priority, one priority level is worth this many engine "
                          "iterations of earlier arrival (iterations that run a step: waiting for the encode or "
                          "decode stage ages no one), so low priorities are delayed, never starved."},
    )
    executor: str = field(
        default="uniproc",
        metadata={"help": "uniproc: one worker in this process | ray: num_workers Ray actors, data parallel "
                          "(pip install dvllm[ray])."},
    )
    num_workers: int = field(default=1, metadata={"help": "Workers (Ray actors), each with its own model and "
                                                          "state pool; needs executor=ray when > 1."})
    ray_address: str | None = field(
        default=None,
        metadata={"help": "None: start a local Ray (or use the one this process already joined); "
                          "'auto' or host:port: join that cluster."},
    )
    worker_num_gpus: float | None = field(
        default=None, metadata={"help": "GPUs per Ray worker (default: 1 when the cluster has GPUs, else 0)."}
    )
    worker_num_cpus: float = field(
        default=1.0, metadata={"help": "CPUs per Ray worker; a CPU worker runs this many torch threads."}
    )
    ray_startup_timeout_s: float = field(
        default=120.0, metadata={"help": "How long Ray start-up may wait for the workers' resources."}
    )
    max_worker_restarts: int = field(
        default=3, metadata={"help": "Times a dead Ray worker is restarted (per worker) before it is given up."}
    )
    worker_restart_timeout_s: float = field(
        default=300.0,
        metadata={"help": "With no worker alive, requests wait this long for a restart before they fail."},
    )
    worker_heartbeat_s: float = field(
        default=2.0,
        metadata={"help": "How often Ray workers with no step in flight are pinged, so one that died idle is "
                          "noticed (its requests moved, /health degraded) within seconds."},
    )
    worker_heartbeat_timeout_s: float = field(
        default=30.0, metadata={"help": "A Ray worker that leaves a ping unanswered this long is taken for dead."}
    )

    def __post_init__(self) -> None:
        from dvllm.step_cache import parse_cache, parse_cache_flag

        # a flag's text, a request-style dict, or a CacheConfig: kept as a CacheConfig (or None)
        if isinstance(self.default_cache, str):
            self.default_cache = parse_cache_flag(self.default_cache)
        self.default_cache = parse_cache(self.default_cache)
        if self.default_params is not None:  # a flag's JSON text or a dict: kept as a checked dict
            from dvllm.param_defaults import parse_defaults

            self.default_params = parse_defaults(self.default_params, "default_params")
        self.lora_modules = parse_named_paths(self.lora_modules)
        self.controlnets = parse_named_paths(self.controlnets, "controlnets")
        check_ip_adapter_config(self.ip_adapter, self.ip_adapter_image_encoder)
        if self.lora_modules:
            self.enable_lora = True
        if self.encode_stage is None:
            self.encode_stage = bool(self.encode_workers)
        self.validate()

    def validate(self) -> None:
        check_config(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)
