"""The worker owns the device, the model and every request's state."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch

from dvllm._extension import custom_ops_available, custom_ops_status
from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.decode_budget import DecodeBudget
from dvllm.lora.cache import lora_cache_for
from dvllm.models.base import ModelAdapter, ModelInfo, denoisers_of
from dvllm.models.load_config import LoadConfig, LoadedModel
from dvllm.models.loader import load_adapter
from dvllm.parallel.group import WorkerGroup
from dvllm.parallel.group_decode import SharedDecode, decodes_in_group
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.profiler import PhaseTimer
from dvllm.runtime.liveness import CallBounds
from dvllm.worker.controlnets import control_modes, load_controlnets
from dvllm.worker.ip_adapter_load import load_ip_adapter
from dvllm.worker.decode_stage import DecodeStage
from dvllm.worker.decode_tiling import measure_budget
from dvllm.worker.decode_worker import start_decode_workers
from dvllm.worker.denoiser import Denoiser
from dvllm.worker.encode_stage import EncodeStage
from dvllm.worker.encode_worker import start_encode_workers
from dvllm.worker.fast_mode import settle
from dvllm.worker.forward_context import DENOISER
from dvllm.worker.model_runner import ModelRunner
from dvllm.worker.output_types import to_output_type
from dvllm.worker.pool_config import PoolConfig
from dvllm.worker.stage_config import StageConfig
from dvllm.worker.stage_process import StageProcess
from dvllm.worker.start_latents import make_start
from dvllm.worker.state_pool import create_state_pool
from dvllm.worker.warm_up import warm_up


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _start_group(config: EngineConfig, adapter: ModelAdapter, device: torch.device,
                 parallel: ParallelConfig) -> WorkerGroup:
    """The worker's group, its every denoiser call shared with the members (and run again if the group fails)."""
    group = WorkerGroup(parallel, config, denoisers_of(adapter.pipeline), device)
    adapter.denoise = group.guard(adapter.denoise)  # the runner reads adapter.denoise per call
    return group


def _bound(processes: list[StageProcess] | None, stages: StageConfig) -> None:
    """The stage processes' calls bounded as the config says: past it a process is taken for lost."""
    for process in processes or []:
        process.bounds = CallBounds(stages.call_timeout_s, stages.start_timeout_s)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        load = LoadConfig.of(config)
        adapter = load_adapter(config.model, config.load_format, self.device, config.dtype,
                               seed=config.dummy_weight_seed, default_params=config.default_params, load=load)
        self.dtype = adapter.dtype  # "auto" resolved for the model's family
        # before the memory profile, which counts them; quantized as the denoiser
        self.controlnets = load_controlnets(config.controlnets, adapter, load.quantization)
        self.ip_adapter = load_ip_adapter(config.ip_adapter, config.ip_adapter_image_encoder, adapter)  # (as well)
        # fast mode's choices (and the other speed settings' defaults) made concrete for this device and denoiser
        self.config = config = settle(config, adapter)
        self.quantization = load.quantization
        # The worker's parts of the settings, resolved once (a Ray worker's too: it is handed the flat config)
        self.stages, self.parallel = stages, parallel = StageConfig.of(config), ParallelConfig.of(config)
        # Before the memory profile: the worker's own text encoders are freed, and their work is not its device's
        encode_devices = list(stages.encode_devices) or ["cpu"]
        encoders = start_encode_workers(adapter, stages.encode_workers, encode_devices,
                                        self.device) if stages.encode_workers else None
        _bound(encoders, stages)
        self.encoders_at = ",".join(encode_devices) if encoders else None  # None: the adapter's encoder_device
        self.group = None
        try:
            self.group = _start_group(config, adapter, self.device, parallel) if parallel.size > 1 else None
            self._build(config, adapter, encoders)
        except BaseException:  # the processes and the process group go with the worker that failed to start
            if self.group is not None:
                self.group.close()
            for process in encoders or []:
                process.close()
            raise

    def _build(self, config: EngineConfig, adapter: ModelAdapter, encoders: Any) -> None:
        """The pool (after the memory profile), the runner and the stages."""
        stages = self.stages
        self.budget = measure_budget(adapter, stages.max_decode_bytes)  # before the profile, which decodes by it
        self.pool, decode_stage = create_state_pool(PoolConfig.of(config), adapter, config, self.budget,
                                                    self.controlnets)
        custom_ops_available(self.device)  # build (or load) the custom ops now, not in the first step
        self.timer = PhaseTimer(config.profile_steps, self.device)
        self.runner = ModelRunner(adapter, self.pool, Denoiser(adapter, config), self.timer, stages.max_decode_batch,
                                  config.max_loras, config.max_lora_rank, lora_cache=lora_cache_for(config),
                                  controlnets=self.controlnets, ip_adapter=self.ip_adapter)
        self.runner.group = self.group
        if config.warm_up:  # before the stages' threads start: a capture has the device to itself
            with torch.inference_mode():
                warm_up(self.runner.denoiser, adapter, self.pool, self.runner.lora)
        if self.group is not None:  # its call hooks read each forward's context (LoRA rows, step caching)
            self.runner.hooks.add(DENOISER, self.group)
        if self.group is not None and decodes_in_group(self.parallel, adapter.pipeline.vae):  # calls shared out
            shared = SharedDecode(self.group, adapter.pipeline.vae)
            self.runner.decode_requests = shared.wrap(self.runner.decode_requests)
        if decode_stage:
            workers = start_decode_workers(adapter, stages.decode_workers,
                                           list(stages.decode_devices) or [str(self.device)],
                                           self.device) if stages.decode_workers else None
            _bound(workers, stages)
            self.runner.decode_stage = DecodeStage(self.runner.decode_requests, to_output_type, self.device,
                                                   stages.max_decode_batch, stages.max_decode_queue, workers)
        if stages.encode_stage:  # as many texts a call as the memory profile measured (two per row)
            prompts = self.runner.prompts
            prompts.encode_stage = EncodeStage(prompts.encode_flat, self.device, stages.encode_batch,
                                               prompts.lock, start=functools.partial(make_start, adapter,
                                                                                    controlnets=self.controlnets),
                                               workers=encoders,
                                               image_prompt=None if self.ip_adapter is None else self.ip_adapter.encode)
            prompts.encoders_released = bool(encoders)

    def model_info(self) -> ModelInfo:
        # what the driver checks requests' control modes against
        return dataclasses.replace(self.runner.adapter.info, control_modes=control_modes(self.controlnets))

    def loaded_model(self) -> LoadedModel:
        adapter = self.runner.adapter
        return LoadedModel(name=adapter.name, device=str(self.device), dtype=_dtype_name(self.dtype),
                           vae_dtype=_dtype_name(adapter.pipeline.vae.dtype),
                           encoder_device=self.encoders_at or str(adapter.encoder_device),
                           quantization=None if self.quantization is None else str(self.quantization),
                           custom_ops=custom_ops_status().as_dict())

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent per step phase on this worker (with profile_steps)."""
        return self.timer.snapshot()

    def decode_budget(self) -> DecodeBudget:
        """Which of this worker's decodes run tiled (max_decode_mb, and its measure at start)."""
        return self.budget

    def pool_info(self) -> tuple[int, int]:
        """(number of blocks, elements per block) of this worker's state pool."""
        return self.pool.num_blocks, self.pool.block_numel

    def close(self) -> None:
        """Finishes what the stages hold (the decode stage's results stay for a last collect)."""
        if self.runner.encode_stage is not None:
            self.runner.encode_stage.close()
        if self.runner.decode_stage is not None:
            self.runner.decode_stage.close(drain=True)
        if self.group is not None:
            self.group.close()
        if self.runner.lora_cache is not None:
            self.runner.lora_cache.close()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        output = self.runner.execute(scheduler_output)
        output.execute_seconds = time.perf_counter() - start
        return output
