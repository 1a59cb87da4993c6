"""What the worker's encode and decode stages take from the engine's settings: whether each runs, its worker
processes and their devices, its batch and queue bounds, and the processes' call bounds, checked here (the flat
EngineConfig stays the one source of the CLI flags and keywords).

`of` takes the flat config as `Any`: dvllm.config is below this package, and naming its type here would make
an import circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dvllm.config_checks import device_list, is_cuda_index, is_number, positive_int

# Most decode (or encode) worker processes one worker may start
MAX_STAGE_WORKERS = 64


@dataclass(frozen=True)
class StageConfig:
    encode_stage: bool = False           # texts (and img2img starts) encoded ahead, off the step loop
    encode_workers: int = 0              # processes that encode for it (0: its thread, in the worker)
    encode_devices: tuple[str, ...] = ()  # where they go, in turn (empty: the CPU)
    encode_batch: int = 32               # texts a call: two per row, as the memory profile measured
    decode_stage: bool | None = None     # None: the memory profile chooses (state_pool.create_state_pool)
    decode_workers: int = 0              # processes that decode for it (0: its thread, in the worker)
    decode_devices: tuple[str, ...] = ()  # where they go, in turn (empty: the worker's device)
    max_decode_batch: int = 4            # images a VAE decode call takes
    max_decode_queue: int = 32           # images handed to the stage and not yet decoded
    max_decode_bytes: int | None = None  # one decode call's bound: requests above it decode tiled (None: none)
    call_timeout_s: float = 300.0        # a stage process's batch left unanswered this long: killed, redone
    start_timeout_s: float = 600.0       # the bound of its calls until it has answered one

    @classmethod
    def of(cls, config: Any) -> StageConfig:
        """The stages' settings of an EngineConfig; ValueError naming a field out of range."""
        check(config)
        return cls(encode_stage=bool(config.encode_stage), encode_workers=config.encode_workers,
                   encode_devices=tuple(device_list(config.encode_device)), encode_batch=2 * config.max_batch_size,
                   decode_stage=config.decode_stage, decode_workers=config.decode_workers,
                   decode_devices=tuple(device_list(config.decode_device)),
                   max_decode_batch=config.max_decode_batch, max_decode_queue=config.max_decode_queue,
                   max_decode_bytes=None if config.max_decode_mb is None else int(config.max_decode_mb * 2**20),
                   call_timeout_s=config.stage_call_timeout_s, start_timeout_s=config.stage_start_timeout_s)


def _check_workers(config: Any, kind: str) -> None:
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


def check_encode_workers(config: Any) -> None:
    """encode_workers and encode_device, and what cannot be combined with encoders that live in processes."""
    _check_workers(config, "encode")
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


def check_decode_workers(config: Any) -> None:
    """decode_workers and decode_device: counts, devices, and the stage they decode for."""
    _check_workers(config, "decode")
    if config.decode_workers and config.decode_stage is False:
        raise ValueError("decode_workers decode for the decode stage: they cannot be combined with "
                         "decode_stage=False")


def check(config: Any) -> None:
    """The stages' fields in range, and the combinations that cannot work refused."""
    for name in ("max_decode_batch", "max_decode_queue"):
        positive_int(name, getattr(config, name))
    if config.max_decode_mb is not None:
        if not (is_number(config.max_decode_mb) and 0 < config.max_decode_mb < float("inf")):
            raise ValueError(f"max_decode_mb must be a finite number > 0 (MiB), got {config.max_decode_mb!r}")
        if config.vae_tiling:
            raise ValueError("max_decode_mb tiles the decodes above it, but vae_tiling tiles every decode already: "
                             "set one of them")
    # finite: a bound that never passes hides a frozen process
    for name in ("stage_call_timeout_s", "stage_start_timeout_s"):
        value = getattr(config, name)
        if not (is_number(value) and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0 (seconds), got {value!r}")
    check_decode_workers(config)
    check_encode_workers(config)
