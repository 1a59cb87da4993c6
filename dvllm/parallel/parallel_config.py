"""What a worker group takes from the engine's settings: its size and split, its members' devices, its policy and
its bounds, checked here (the flat EngineConfig stays the one source of the CLI flags and keywords).

`of` takes the flat config as `Any`: dvllm.config is below this package, and naming its type here would make
an import circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dvllm.config_checks import choice, device_list, is_cuda_index, is_number, positive_int

GROUP_POLICIES = ("static", "elastic")


@dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel_size: int = 1  # processes that split each row group's tokens
    cfg_parallel_size: int = 1       # row groups that split each forward's rows
    ring_degree: int = 1             # 1: Ulysses; sequence_parallel_size: Ring
    devices: tuple[str, ...] = ()    # the members' devices as given (empty: after the worker's, see member_devices)
    elastic: bool = False            # group_policy=elastic: the split chosen per step
    group_decode: bool = False       # the group shares its decodes (a group, asked for, and no decode workers)
    timeout_s: float = 300.0         # a collective's (and a member call's) bound
    start_timeout_s: float = 600.0   # a member's calls' bound until it has answered one (its start)

    @property
    def size(self) -> int:
        """The processes that run each forward: the worker and its group's members."""
        return self.sequence_parallel_size * self.cfg_parallel_size

    @classmethod
    def of(cls, config: Any) -> ParallelConfig:
        """The group's settings of an EngineConfig; ValueError naming a field out of range."""
        check(config)
        size = config.sequence_parallel_size * config.cfg_parallel_size
        return cls(sequence_parallel_size=config.sequence_parallel_size, cfg_parallel_size=config.cfg_parallel_size,
                   ring_degree=config.ring_degree, devices=tuple(device_list(config.group_devices)),
                   elastic=config.group_policy == "elastic",
                   group_decode=size > 1 and config.group_decode and not config.decode_workers,
                   timeout_s=config.group_timeout_s, start_timeout_s=config.stage_start_timeout_s)


def check(config: Any) -> None:
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
    group_size = size * config.cfg_parallel_size
    if group_size == 1:
        if config.group_devices is not None:
            raise ValueError("group_devices is set but the group has one process (sequence_parallel_size and "
                             "cfg_parallel_size are 1)")
        return
    devices = device_list(config.group_devices)
    if config.group_devices is not None and len(devices) != group_size - 1:
        raise ValueError(f"group_devices names {len(devices)} device(s); a group of {group_size} has "
                         f"{group_size - 1} members besides the worker")
    for device in devices:
        if not (device == "cpu" or is_cuda_index(device)):
            raise ValueError(f"group_devices: {device!r} is not 'cpu' or 'cuda:N'")
    # (fast, compile and cuda_graph are the denoiser's settings: read here only to refuse them in a group)
    unserved = [name for name, on in (("fast (its compile and CUDA graphs)", config.fast),
                                      ("compile", config.compile not in (None, "off")),
                                      ("cuda_graph", config.cuda_graph),
                                      # the leader runs the controlnets, but the members' UNets never add them
                                      ("controlnets", bool(config.controlnets)),
                                      # (the members' UNets have no row-scaled IP-Adapter processors)
                                      ("ip_adapter", bool(getattr(config, "ip_adapter", None)))) if on]
    if unserved:
        raise ValueError(f"a worker group (sequence_parallel_size or cfg_parallel_size > 1) does not serve "
                         f"{', '.join(unserved)} yet: every member's denoiser would have to run them alike")
