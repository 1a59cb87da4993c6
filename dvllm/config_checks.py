"""The value checks EngineConfig.validate runs on its fields: each raises ValueError naming the field.

The checks take the config as `Config` (an EngineConfig): this module names no type of config.py, which imports
it, so that the two make no import circle."""
from __future__ import annotations

from typing import Any

Config = Any  # an EngineConfig

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
SCHEDULING_POLICIES = ("fcfs", "priority")
BATCHING_POLICIES = ("step", "request")
SHAPE_ORDERS = ("auto", "oldest", "turns")
GROUP_POLICIES = ("static", "elastic")
COMPILE_MODES = ("off", "regional", "dynamic", "bucketed")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
EXECUTORS = ("uniproc", "ray")

# Most decode (or encode) worker processes one worker may start
MAX_STAGE_WORKERS = 64


def parse_lora_modules(value: Any) -> dict[str, str]:
    """{name: path}, or the flag's ["name=path", ...]."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        pairs = {}
        for item in value:
            name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not (sep and name and path):
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
            if name in pairs:
                raise ValueError(f"lora_modules: {name!r} is given twice")
            pairs[name] = path
        return pairs
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ValueError(f"lora_modules must map adapter names to paths, got {value!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def non_negative(name: str, value: Any) -> None:
    if not (is_number(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()


def check_encoder_device(config: Config) -> None:
    """encoder_device: a device name, and no combination that cannot work."""
    device = config.encoder_device
    if device is None:
        return
    if not (device in ("cpu", "cuda") or is_cuda_index(device)):
        raise ValueError(f"encoder_device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if config.enable_lora:
        raise ValueError("encoder_device cannot be combined with LoRA serving: an adapter's text-encoder "
                         "layers read their weights from slot tables on the worker's device")
    if device != "cpu" and config.num_workers > 1:
        raise ValueError(f"encoder_device {device!r} with {config.num_workers} workers would put every worker's "
                         "text encoders on one GPU: use 'cpu', or one worker per engine")


def check_limits(config: Config) -> None:
    """The numeric limits that are not plain positive integers."""
    if not (is_number(config.max_lora_file_mb) and 0 < config.max_lora_file_mb < float("inf")):
        raise ValueError(f"max_lora_file_mb must be a finite number > 0, got {config.max_lora_file_mb!r}")
    if not (is_number(config.max_guidance_scale) and 0 <= config.max_guidance_scale < float("inf")):
        raise ValueError(f"max_guidance_scale must be a finite number >= 0, got {config.max_guidance_scale!r}")
    if isinstance(config.result_cache_mb, bool) or not isinstance(config.result_cache_mb, int) \
            or config.result_cache_mb < 0:
        raise ValueError(f"result_cache_mb must be an integer >= 0 (0: off), got {config.result_cache_mb!r}")
    if config.num_state_blocks is not None:
        positive_int("num_state_blocks", config.num_state_blocks)
    if config.state_pool_mb is not None and not (isinstance(config.state_pool_mb, (int, float))
                                                 and config.state_pool_mb > 0):
        raise ValueError(f"state_pool_mb must be a number > 0, got {config.state_pool_mb!r}")


def check_workers(config: Config) -> None:
    """The executor's workers: counts, Ray's settings, timeouts and restarts."""
    if config.num_workers > 1 and config.executor != "ray":
        raise ValueError(f"num_workers={config.num_workers} needs executor='ray' (the uniproc executor has one)")
    if config.executor != "ray" and config.ray_address is not None:
        raise ValueError("ray_address is set but executor is not 'ray'")
    if config.worker_num_gpus is not None:
        non_negative("worker_num_gpus", config.worker_num_gpus)
    non_negative("worker_num_cpus", config.worker_num_cpus)
    for name in ("ray_startup_timeout_s", "worker_restart_timeout_s", "worker_heartbeat_s",
                 "worker_heartbeat_timeout_s"):
        if not (is_number(getattr(config, name)) and getattr(config, name) > 0):
            raise ValueError(f"{name} must be a number > 0, got {getattr(config, name)!r}")
    if not isinstance(config.max_worker_restarts, int) or isinstance(config.max_worker_restarts, bool) \
            or config.max_worker_restarts < 0:
        raise ValueError(f"max_worker_restarts must be an integer >= 0, got {config.max_worker_restarts!r}")


def check_liveness(config: Config) -> None:
    """The heartbeat and call bounds: finite numbers > 0 (a bound that never passes hides a frozen process)."""
    for name in ("stage_call_timeout_s", "stage_start_timeout_s", "core_heartbeat_timeout_s"):
        value = getattr(config, name)
        if not (is_number(value) and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0 (seconds), got {value!r}")


def device_list(devices: str | None) -> list[str]:
    """A comma-separated device list's names ([] for None)."""
    return [] if devices is None else [device.strip() for device in devices.split(",")]


def _check_stage_workers(config: Config, kind: str) -> None:
    """<kind>_workers and <kind>_device: a count in range and device names."""
    count, devices = getattr(config, f"{kind}_workers"), getattr(config, f"{kind}_device")
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_STAGE_WORKERS:
        raise ValueError(f"{kind}_workers must be an integer in [0, {MAX_STAGE_WORKERS}], got {count!r}")
    if devices is not None:
        if not count:
            raise ValueError(f"{kind}_device is set but {kind}_workers is 0")
        for device in device_list(devices):
            if not (device in ("cpu", "cuda") or is_cuda_index(device)):
                raise ValueError(f"{kind}_device must be 'cpu', 'cuda' or 'cuda:N' (or several, comma-separated), "
                                 f"got {devices!r}")


def check_encode_workers(config: Config) -> None:
    """encode_workers and encode_device, and what cannot be combined with encoders that live in processes."""
    _check_stage_workers(config, "encode")
    if not config.encode_workers:
        return
    if config.encode_stage is False:
        raise ValueError("encode_workers encode for the encode stage: they cannot be combined with "
                         "encode_stage=False")
    if config.enable_lora:
        raise ValueError("encode_workers cannot be combined with LoRA serving: an adapter's text-encoder layers "
                         "run in the worker, which holds no text encoders with encode workers")
    if config.encoder_device is not None:
        raise ValueError("encoder_device places the worker's own text encoders; with encode_workers they live in "
                         "the encode processes: use encode_device")
    if config.max_encode_ahead < 3:  # every text waits for the stage: a request's two texts and start must fit
        raise ValueError(f"encode_workers needs max_encode_ahead >= 3 (a request's prompt, negative prompt and "
                         f"input images), got {config.max_encode_ahead}")


def check_decode_workers(config: Config) -> None:
    """decode_workers and decode_device: counts, devices, and the stage they decode for."""
    _check_stage_workers(config, "decode")
    if config.decode_workers and config.decode_stage is False:
        raise ValueError("decode_workers decode for the decode stage: they cannot be combined with "
                         "decode_stage=False")


def check_group(config: Config) -> None:
    """A worker group's size, split, devices and timeout, and what it does not serve yet."""
    size, ring = config.sequence_parallel_size, config.ring_degree
    for name in ("sequence_parallel_size", "cfg_parallel_size", "ring_degree"):
        positive_int(name, getattr(config, name))
    if not (is_number(config.group_timeout_s) and config.group_timeout_s > 0):
        raise ValueError(f"group_timeout_s must be a number > 0, got {config.group_timeout_s!r}")
    if ring not in (1, size):
        raise ValueError(f"ring_degree must be 1 (Ulysses) or sequence_parallel_size, {size} (Ring), got {ring}: a "
                         "mix of the two splits only sequences both divide, so it is not served")
    choice("group_policy", config.group_policy, GROUP_POLICIES)
    if config.group_policy == "elastic" and (size == 1 or config.cfg_parallel_size > 1):
        raise ValueError("group_policy='elastic' chooses each step between splitting the forward's tokens and its "
                         "rows: it needs sequence_parallel_size > 1 (a group that can split tokens; any group can "
                         "split rows) and cfg_parallel_size 1 (a static split of the rows)")
    if config.group_size == 1:
        if config.group_devices is not None:
            raise ValueError("group_devices is set but the group has one process (sequence_parallel_size and "
                             "cfg_parallel_size are 1)")
        return
    devices = device_list(config.group_devices)
    if config.group_devices is not None and len(devices) != config.group_size - 1:
        raise ValueError(f"group_devices names {len(devices)} device(s); a group of {config.group_size} has "
                         f"{config.group_size - 1} members besides the worker")
    for device in devices:
        if not (device == "cpu" or is_cuda_index(device)):
            raise ValueError(f"group_devices: {device!r} is not 'cpu' or 'cuda:N'")
    unserved = [name for name, on in (("fast (its compile and CUDA graphs)", config.fast),
                                      ("compile", config.compile not in (None, "off")),
                                      ("cuda_graph", config.cuda_graph)) if on]
    if unserved:
        raise ValueError(f"a worker group (sequence_parallel_size or cfg_parallel_size > 1) does not serve "
                         f"{', '.join(unserved)} yet: every member's denoiser would have to run them alike")


def check_compile(config: Config) -> None:
    """compile, its backend, CUDA graphs and the warm-up, as set (None: unset, fast mode's to choose)."""
    if config.compile is not None:
        choice("compile", config.compile, COMPILE_MODES)
    compiled = config.compile not in (None, "off") or (config.compile is None and config.fast)
    if config.compile_backend is not None:
        choice("compile_backend", config.compile_backend, COMPILE_BACKENDS)
        if not compiled:
            raise ValueError("compile_backend is set but compile is 'off': it picks the backend of a compiled "
                             "denoiser")
    if config.cuda_graph and config.device == "cpu":
        raise ValueError("cuda_graph needs a CUDA device, but device is 'cpu'")
    for name in ("fast", "cuda_graph", "warm_up", "channels_last"):
        value = getattr(config, name)
        if not (isinstance(value, bool) or (value is None and name != "fast")):
            raise ValueError(f"{name} must be true or false, got {value!r}")


def check_config(config: Config) -> None:
    """Every knob in range, and the combinations that cannot work refused."""
    choice("load_format", config.load_format, LOAD_FORMATS)
    choice("dtype", config.dtype, DTYPES)
    choice("vae_dtype", config.vae_dtype, DTYPES)
    if config.vae_tile_size is not None:
        positive_int("vae_tile_size", config.vae_tile_size)
        if not config.vae_tiling:
            raise ValueError("vae_tile_size is set but vae_tiling is off: it sizes the tiles of a tiled decode")
    choice("scheduling_policy", config.scheduling_policy, SCHEDULING_POLICIES)
    choice("batching", config.batching, BATCHING_POLICIES)
    choice("shape_order", config.shape_order, SHAPE_ORDERS)
    if config.shape_order == "oldest" and config.group_policy == "elastic":
        raise ValueError("shape_order='oldest' with group_policy='elastic': the elastic policy's deadline pace counts "
                         "a step of every shape per step (shapes in turn); leave shape_order at auto (turns there)")
    if not 0 <= config.request_batch_wait_s <= 60:
        raise ValueError(f"request_batch_wait_s must be within [0, 60] seconds, got {config.request_batch_wait_s}")
    if config.request_batch_wait_s and config.batching != "request":
        raise ValueError("request_batch_wait_s is the request-level policy's window: set batching='request' with it")
    check_compile(config)
    choice("executor", config.executor, EXECUTORS)
    if not (config.device in ("auto", "cpu", "cuda") or is_cuda_index(config.device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {config.device!r}")
    for name in ("max_batch_size", "max_num_waiting", "max_inference_steps", "max_images_per_prompt",
                 "max_prompt_chars", "sampler_plan_cache_size", "priority_aging_iterations", "num_workers",
                 "max_decode_batch", "max_decode_queue", "max_encode_ahead", "max_cuda_graphs", "max_loras",
                 "max_lora_rank",
                 "max_input_images_per_step"):
        positive_int(name, getattr(config, name))
    for name in ("max_image_pixels", "max_running_pixels", "max_prompt_chars_per_step", "max_cpu_loras"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
    check_limits(config)
    check_workers(config)
    check_liveness(config)
    if not (isinstance(config.gpu_memory_utilization, (int, float)) and 0 < config.gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization!r}")
    check_encoder_device(config)
    check_decode_workers(config)
    check_encode_workers(config)
    check_group(config)
