"""dvllm's tensor ops with their pure-torch reference.

`sampler_update` is the one update every vectorized sampler reduces to. Each row r
carries its own coefficients (one row of `coeffs`, laid out as dvllm/sampler_coeffs.py says):

    x0   = clamp(ax * sample + am * model_output, -clip, clip)
    prev = cs * sample + cm * model_output + cx * x0 + cn * noise + sum_k ch_k * history[k]

x0 is the row's prediction of the clean latent (multistep samplers keep their last few as
history slots, and previews decode it). DDIM, Euler, Euler ancestral, DPM-Solver++ (orders
1-3), UniPC (its predictor and corrector, orders 1-3) and LCM are exactly this form with
step-dependent coefficients; see dvllm/samplers.

The state-pool ops move rows between the paged state pool and dense batches. The pool
is one contiguous [num_blocks, B] tensor; element i of row r lives at
pool[table[r, i // B], i % B], with table an int32 [R, ceil(numel / B)] block table
on the pool's device (every entry a valid block id unless said otherwise):

    gather_blocks   pool -> [R, numel] batch
    scatter_blocks  [R, numel] batch -> pool (only the addressed elements)
    scatter_update  sampler_update read from and written back into the pool, fused; each row's
                    x0 replaces its history slot 0 (the oldest), which the host rotates per step

Each wrapper runs dvllm's custom op (csrc/, built on first use by dvllm._extension)
when it has a kernel for the pool's device, else the `*_ref` function next to it, which
defines what the op means. DVLLM_USE_CUSTOM_OPS=0 forces the reference. Tensors the ops
write (pool, out) must be contiguous; read-only inputs are made contiguous if needed.
Rows that an op writes must not share blocks with each other (reads may share).
"""
from __future__ import annotations

from typing import Sequence

import torch

from dvllm._extension import custom_ops_available
from dvllm.sampler_coeffs import HISTORY_COEFFS, MAX_HISTORY, NUM_COEFFS, Coeff

AX, AM, CLIP, CS, CM, CX, CH, CN, CH1, CH2 = (int(c) for c in Coeff)  # short names for the formulas below


def sampler_update(
    sample: torch.Tensor,        # [R, C, H, W] current latents
    model_output: torch.Tensor,  # [R, C, H, W] guided denoiser output
    coeffs: torch.Tensor,        # [R, NUM_COEFFS] float32
    history: Sequence[torch.Tensor] = (),  # up to MAX_HISTORY [R, C, H, W]: earlier x0 by slot (multistep)
    noise: torch.Tensor | None = None,    # [R, C, H, W] ancestral noise, or None
    clip: bool = False,          # whether any row clamps x0 (skips the clamp otherwise)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (prev_sample, x0), both float32."""
    # [R, NUM_COEFFS, 1, ...]: c[:, k] broadcasts per row over latents of any layout (packed ones are [R, N, D])
    c = coeffs.to(torch.float32).view(*coeffs.shape, *[1] * (sample.dim() - 1))
    sample = sample.to(torch.float32)
    model_output = model_output.to(torch.float32)
    x0 = c[:, AX] * sample + c[:, AM] * model_output
    if clip:
        x0 = torch.maximum(torch.minimum(x0, c[:, CLIP]), -c[:, CLIP])
    prev = c[:, CS] * sample + c[:, CM] * model_output + c[:, CX] * x0
    if noise is not None:
        prev = prev + c[:, CN] * noise.to(torch.float32)
    for column, slot in zip(HISTORY_COEFFS, history):
        prev = prev + c[:, column] * slot.to(torch.float32)
    return prev, x0


# ---- State-pool ops: wrappers ----

def gather_blocks(
    pool: torch.Tensor,         # [num_blocks, B]
    block_table: torch.Tensor,  # [R, ceil(numel / B)] int32; rows may share blocks
    numel: int,
    out: torch.Tensor | None = None,  # [R, numel] in pool.dtype, contiguous
) -> torch.Tensor:
    """Returns the rows as a dense [R, numel] tensor in pool.dtype (`out` if given)."""
    _check_pool(pool)
    if not isinstance(numel, (int, torch.SymInt)) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    rows = _check_table("block_table", block_table, pool, numel)
    if out is not None:
        _check_rows("out", out, pool, rows, numel, allowed=(pool.dtype,))
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if not _use_custom_ops(pool):
        ref = gather_blocks_ref(pool, block_table, numel)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = pool.new_empty((rows, numel))
    torch.ops.dvllm.gather_blocks(out, pool, block_table.contiguous())
    return out


def scatter_blocks(
    src: torch.Tensor,          # [R, numel], any float dtype (cast to pool.dtype)
    pool: torch.Tensor,         # [num_blocks, B], written in place
    block_table: torch.Tensor,  # [R, ceil(numel / B)] int32; rows must not share blocks
) -> None:
    """Writes each row of src to its blocks; the rest of the pool (a last block's tail too) is untouched."""
    _check_pool(pool)
    if src.dim() != 2:
        raise ValueError(f"src must be 2-D [R, numel], got shape {tuple(src.shape)}")
    rows = _check_table("block_table", block_table, pool, src.shape[1])
    _check_rows("src", src, pool, rows, src.shape[1], allowed=_FLOAT_DTYPES)
    src = src.to(pool.dtype)
    if _use_custom_ops(pool):
        torch.ops.dvllm.scatter_blocks(src.contiguous(), pool, block_table.contiguous())
    else:
        scatter_blocks_ref(src, pool, block_table)


def scatter_update(
    pool: torch.Tensor,          # [num_blocks, B], updated in place
    latent_table: torch.Tensor,  # [R, nb] int32: each row's latents (read, then written)
    model_output: torch.Tensor,  # [R, numel] float32 or pool.dtype
    coeffs: torch.Tensor,        # [R, NUM_COEFFS] float32
    history_table: torch.Tensor | None = None,  # [R, K, nb] int32, K <= MAX_HISTORY: each row's history slots
    noise: torch.Tensor | None = None,          # [R, numel] float32 or pool.dtype
    clip: bool = False,
) -> None:
    """`sampler_update` on rows of the pool, fused: latents <- prev; history slot 0 <- x0.

    A slot whose first block id is -1 is absent (a row of samplers that keep fewer slots, or none): not read,
    and, for slot 0, not written. A [R, nb] history_table is one slot per row. All math is in float32;
    results are stored in pool.dtype. Written rows (latents and slot 0) must not share blocks with each other.
    """
    _check_pool(pool)
    if model_output.dim() != 2:
        raise ValueError(f"model_output must be 2-D [R, numel], got shape {tuple(model_output.shape)}")
    rows, numel = model_output.shape
    if _check_table("latent_table", latent_table, pool, numel) != rows:
        raise ValueError(f"latent_table has {latent_table.shape[0]} rows but model_output has {rows}")
    _check_rows("model_output", model_output, pool, rows, numel, allowed=(torch.float32, pool.dtype))
    _check_rows("coeffs", coeffs, pool, rows, NUM_COEFFS, allowed=(torch.float32,))
    if history_table is not None:
        history_table = _history_slots(history_table, pool, rows, numel)
    if noise is not None:
        _check_rows("noise", noise, pool, rows, numel, allowed=(torch.float32, pool.dtype))
    if not _use_custom_ops(pool):
        scatter_update_ref(pool, latent_table, model_output, coeffs, history_table, noise, clip)
        return
    torch.ops.dvllm.scatter_update(
        pool, latent_table.contiguous(), model_output.contiguous(), coeffs.contiguous(),
        None if history_table is None else history_table.contiguous(),
        None if noise is None else noise.contiguous(), bool(clip))


def _history_slots(table: torch.Tensor, pool: torch.Tensor, rows: int, numel: int) -> torch.Tensor:
    """The history table as [R, K, nb], checked (metadata only)."""
    if table.dim() == 2:
        table = table.unsqueeze(1)
    if table.dim() != 3 or not 1 <= table.shape[1] <= MAX_HISTORY:
        raise ValueError(f"history_table must be [R, K, nb] with 1 <= K <= {MAX_HISTORY}, got {tuple(table.shape)}")
    if _check_table("history_table", table.flatten(0, 1), pool, numel) != rows * table.shape[1]:
        raise ValueError(f"history_table has {table.shape[0]} rows but model_output has {rows}")
    return table


# ---- State-pool ops: pure-torch references (they define what the ops mean) ----

def gather_blocks_ref(pool: torch.Tensor, block_table: torch.Tensor, numel: int) -> torch.Tensor:
    return pool.view(-1)[_flat_index(block_table, numel, pool.shape[1])]


def scatter_blocks_ref(src: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor) -> None:
    pool.view(-1)[_flat_index(block_table, src.shape[1], pool.shape[1])] = src.to(pool.dtype)


def scatter_update_ref(
    pool: torch.Tensor,
    latent_table: torch.Tensor,
    model_output: torch.Tensor,
    coeffs: torch.Tensor,
    history_table: torch.Tensor | None = None,  # [R, K, nb] (or [R, nb]: one slot)
    noise: torch.Tensor | None = None,
    clip: bool = False,
) -> None:
    flat, numel, block_numel = pool.view(-1), model_output.shape[1], pool.shape[1]
    x_index = _flat_index(latent_table, numel, block_numel)
    x = flat[x_index].float()
    mo = model_output.float()
    c = coeffs.float()[:, :, None]  # c[:, K] is [R, 1]
    x0 = c[:, AX] * x + c[:, AM] * mo
    if clip:
        x0 = torch.maximum(torch.minimum(x0, c[:, CLIP]), -c[:, CLIP])
    prev = c[:, CS] * x + c[:, CM] * mo + c[:, CX] * x0
    if noise is not None:
        prev = prev + c[:, CN] * noise.float()
    if history_table is not None:
        if history_table.dim() == 2:  # one slot a row
            history_table = history_table.unsqueeze(1)
        # Absent slots aim at the row's own latents (read with weight 0; slot 0's write is then overwritten by
        # the latent write below): no boolean indexing, so shapes stay static.
        slots = []
        for k, column in enumerate(HISTORY_COEFFS[:history_table.shape[1]]):
            table = history_table[:, k]
            has = table[:, :1] >= 0  # [R, 1]
            index = torch.where(has, _flat_index(table, numel, block_numel), x_index)
            prev = prev + torch.where(has, c[:, column] * flat[index].float(), 0.0)
            slots.append(index)
        flat[slots[0]] = x0.to(pool.dtype)
    flat[x_index] = prev.to(pool.dtype)


def _flat_index(table: torch.Tensor, numel: int, block_numel: int) -> torch.Tensor:
    """[R, numel] int64: where each row's elements live in pool.view(-1)."""
    cols = torch.arange(numel, device=table.device)
    return table[:, cols // block_numel].long() * block_numel + cols % block_numel


# ---- State-pool ops: argument checks (metadata only: no device sync) ----

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float64, *_POOL_DTYPES)


def _use_custom_ops(pool: torch.Tensor) -> bool:
    return custom_ops_available(pool.device)


def _check_pool(pool: torch.Tensor) -> None:
    if pool.dim() != 2 or pool.shape[1] == 0:
        raise ValueError(f"pool must be 2-D [num_blocks, block_numel], got shape {tuple(pool.shape)}")
    if pool.dtype not in _POOL_DTYPES:
        raise ValueError(f"pool must be float32, float16 or bfloat16, got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")


def _check_table(name: str, table: torch.Tensor, pool: torch.Tensor, numel: int) -> int:
    """Checks an int32 [R, ceil(numel / B)] block table on the pool's device; returns R."""
    num_cols = -(-numel // pool.shape[1])
    if table.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {table.dtype}")
    if table.dim() != 2 or table.shape[1] != num_cols:
        raise ValueError(f"{name} must have shape [R, {num_cols}] (ceil({numel} / {pool.shape[1]}) blocks "
                         f"a row), got {tuple(table.shape)}")
    if table.device != pool.device:
        raise ValueError(f"{name} is on {table.device} but pool is on {pool.device}")
    return table.shape[0]


def _check_rows(name: str, t: torch.Tensor, pool: torch.Tensor, rows: int, numel: int,
                allowed: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != (rows, numel):
        raise ValueError(f"{name} must have shape {(rows, numel)}, got {tuple(t.shape)}")
    if t.dtype not in allowed:
        raise ValueError(f"{name} must be {' or '.join(sorted({str(d) for d in allowed}))}, got {t.dtype}")
    if t.device != pool.device:
        raise ValueError(f"{name} is on {t.device} but pool is on {pool.device}")
