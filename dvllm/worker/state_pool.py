"""The state pool: one preallocated [num_blocks, block_numel] tensor on the worker's device.

Every request's per-row state (latents of one image, its sampler history, a prompt's
embeddings) is a flat vector in the blocks its block table lists; dvllm.ops gathers
a batch out of the pool and scatters results back. The driver's BlockManager decides
which blocks are whose; this only holds the memory.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from dvllm import ops
from dvllm.config import CPU_STATE_POOL_MB
from dvllm.decode_budget import DecodeBudget
from dvllm.host_copy import device_tensor
from dvllm.models.base import ModelAdapter, ModelInfo
from dvllm.worker.pool_config import PoolConfig

logger = logging.getLogger(__name__)


def choose_block_numel(info: ModelInfo) -> int:
    """Block size in elements, from the model's own data.

    A quarter of one default-size image's latents, as a power of two in [256, 65536]:
    images at the default size fill whole blocks, other sizes and the prompt
    embeddings waste less than one block each (a few percent of their state), and a
    block stays a contiguous run of at least 512 bytes, so gather/scatter copy runs,
    not single elements. SD 1.5: 4096 elements (a 64x64x4 latent is 4 blocks, a
    77x768 embedding 15).
    """
    target = max(1, info.latents.numel(*info.default_size) // 4)
    return min(65536, max(256, 1 << (target.bit_length() - 1)))


class StatePool:
    def __init__(self, num_blocks: int, block_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_numel = block_numel
        self.device = device
        self.data = torch.empty((num_blocks, block_numel), dtype=dtype, device=device)

    def table(self, rows: list[list[int]]) -> torch.Tensor:
        """Block ids, one list per row -> the int32 table the ops take."""
        return device_tensor(rows, self.device, torch.int32)

    def read(self, rows: list[list[int]], numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return ops.gather_blocks(self.data, self.table(rows), numel, out=out)

    def view(self, rows: list[list[int]], numel: int) -> torch.Tensor | None:
        """[rows, numel] as a view of the pool, where the rows' blocks are one run, row after row (the
        scheduler allocates a step cache so): what is written to it is written to the pool. None otherwise."""
        per_row, first = len(rows[0]), rows[0][0] if rows[0] else 0
        if any(row != list(range(first + i * per_row, first + (i + 1) * per_row)) for i, row in enumerate(rows)):
            return None
        return self.data[first:first + len(rows) * per_row].view(len(rows), -1)[:, :numel]

    def write(self, rows: list[list[int]], values: torch.Tensor) -> None:
        ops.scatter_blocks(values.reshape(len(rows), -1), self.data, self.table(rows))

    def blocks_for(self, numel: int) -> int:
        return math.ceil(numel / self.block_numel)


def create_state_pool(config: PoolConfig, adapter: ModelAdapter, engine_config: Any,
                      decode_budget: DecodeBudget | None = None,
                      controlnets: dict[str, Any] | None = None) -> tuple[StatePool, bool]:
    """The pool, and whether the decode stage runs (the GPU memory profile chooses when it is left unset).
    `engine_config`: the flat EngineConfig whose limits the GPU memory profile sizes the worst step from;
    `decode_budget`: which decodes run tiled (the profile measures the worst one as it will run);
    `controlnets`: the engine's (the profile's worst forward has controls on every row)."""
    info = adapter.info
    block_numel = choose_block_numel(info)
    bytes_per_block = block_numel * torch.empty((), dtype=adapter.state_dtype).element_size()
    if config.num_state_blocks is not None:
        num_blocks, decode_stage = config.num_state_blocks, config.decode_stage is not False
    else:
        pool_bytes, decode_stage = _pool_bytes(config, adapter, engine_config, decode_budget, controlnets)
        num_blocks = pool_bytes // bytes_per_block
    pool = StatePool(num_blocks, block_numel, adapter.state_dtype, adapter.device)
    logger.info("state pool: %d blocks of %d elements (%.1f MiB)", num_blocks, block_numel,
                num_blocks * bytes_per_block / 2**20)
    return pool, decode_stage


def _pool_bytes(config: PoolConfig, adapter: ModelAdapter, engine_config: Any,
                decode_budget: DecodeBudget | None, controlnets: dict[str, Any] | None) -> tuple[int, bool]:
    stage = config.decode_stage is not False  # auto: on where memory is not profiled
    if config.state_pool_mb is not None:
        return int(config.state_pool_mb * 2**20), stage
    if adapter.device.type != "cuda":
        return CPU_STATE_POOL_MB * 2**20, stage
    # As vLLM sizes its KV cache: what gpu_memory_utilization leaves once the weights are in and the
    # worst step the engine's limits allow has shown its peak (worker/memory_profile.py).
    from dvllm.worker.memory_profile import DeviceMemory, gpu_pool_bytes

    return gpu_pool_bytes(adapter, engine_config, DeviceMemory(adapter.device), decode_budget, controlnets)
