"""The value checks EngineConfig.validate runs on the fields no one package owns: each raises ValueError naming
the field. The packages check their own when they resolve their part of the config (engine/configs.py: the
scheduler's, the state pool's, the stages', the group's); the helpers below are theirs too.

The checks take the config as `Config` (an EngineConfig): this module names no type of config.py, which imports
it, so that the two make no import circle."""
from __future__ import annotations

from typing import Any

Config = Any  # an EngineConfig

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPILE_MODES = ("off", "regional", "dynamic", "bucketed")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
EXECUTORS = ("uniproc", "ray")


def parse_named_paths(value: Any, field: str = "lora_modules") -> dict[str, str]:
    """{name: path}, or the flag's ["name=path", ...] (`field`: the setting's name, for its errors)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        pairs = {}
        for item in value:
            name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not (sep and name and path):
                raise ValueError(f"{field}: expected name=path, got {item!r}")
            if name in pairs:
                raise ValueError(f"{field}: {name!r} is given twice")
            pairs[name] = path
        return pairs
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ValueError(f"{field} must map names to paths, got {value!r}")


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
    """The core's heartbeat bound: a finite number > 0 (a bound that never passes hides a frozen process; the
    stages' call bounds are worker/stage_config.py's)."""
    value = config.core_heartbeat_timeout_s
    if not (is_number(value) and 0 < value < float("inf")):
        raise ValueError(f"core_heartbeat_timeout_s must be a finite number > 0 (seconds), got {value!r}")


def device_list(devices: str | None) -> list[str]:
    """A comma-separated device list's names ([] for None)."""
    return [] if devices is None else [device.strip() for device in devices.split(",")]


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


def check_controlnets(config: Config) -> None:
    """The modes ControlNet is not served with, refused before anything loads (a worker group's refusal is the
    group's, and a family's is the loader's)."""
    if config.controlnets and config.default_cache is not None:
        raise ValueError("controlnets with default_cache: not served together yet (controlled requests beside "
                         "step-cached ones are not checked against diffusers yet)")


def check_config(config: Config) -> None:
    """Every knob in range, and the combinations that cannot work refused."""
    choice("load_format", config.load_format, LOAD_FORMATS)
    choice("dtype", config.dtype, DTYPES)
    choice("vae_dtype", config.vae_dtype, DTYPES)
    if config.vae_tile_size is not None:
        positive_int("vae_tile_size", config.vae_tile_size)
        if not config.vae_tiling and config.max_decode_mb is None:
            raise ValueError("vae_tile_size is set but neither vae_tiling nor max_decode_mb tiles a decode: it sizes "
                             "the tiles of a tiled decode")
    check_compile(config)
    choice("executor", config.executor, EXECUTORS)
    if not (config.device in ("auto", "cpu", "cuda") or is_cuda_index(config.device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {config.device!r}")
    for name in ("max_batch_size", "max_num_waiting", "max_inference_steps", "max_images_per_prompt",
                 "max_prompt_chars", "sampler_plan_cache_size", "num_workers", "max_cuda_graphs", "max_loras",
                 "max_lora_rank"):
        positive_int(name, getattr(config, name))
    for name in ("max_image_pixels", "max_cpu_loras"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
    check_limits(config)
    check_workers(config)
    check_liveness(config)
    check_encoder_device(config)
    check_controlnets(config)
