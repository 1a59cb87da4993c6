"""Which running requests to preempt for one that does not fit (scheduling_policy="priority"): from the least
urgent candidate on, only as many as it takes to free what the request lacks in rows of its shape, blocks,
LoRA slots or running pixels (max_running_pixels); none if all of them together would not free enough."""
from __future__ import annotations

from dvllm.core.block_manager import BlockManager
from dvllm.core.lora_slots import LoraSlots
from dvllm.core.request import Request


def choose_victims(wanted: Request, candidates: list[Request], need_rows: int, need_blocks: int, need_slots: int,
                   blocks: BlockManager, slots: LoraSlots) -> list[Request] | None:
    """The victims, least urgent first (`candidates` come in that order), or None if preempting cannot make
    `wanted` fit."""
    chosen: list[Request] = []
    freed_rows = freed_blocks = freed_slots = 0
    for victim in candidates:
        if freed_rows >= need_rows and freed_blocks >= need_blocks and freed_slots >= need_slots:
            break
        chosen.append(victim)
        freed_blocks += victim.private_blocks + _shared_blocks_freed(victim, chosen, wanted, blocks)
        if victim.shape_key == wanted.shape_key:
            freed_rows += victim.rows
        freed_slots = slots.freed_by([a for r in chosen for a in r.lora_adapters])
    if freed_rows < need_rows or freed_blocks < need_blocks or freed_slots < need_slots:
        return None
    return chosen


def _shared_blocks_freed(victim: Request, chosen: list[Request], wanted: Request, blocks: BlockManager) -> int:
    """Blocks of victim's shared entries (prompts, control images) that no one else holds (and `wanted` will not
    reuse)."""
    freed, reused = 0, {*wanted.cond_keys, *wanted.control_keys}
    for entry in dict.fromkeys(victim.shared_entries):  # (two controls of one request may hold one entry)
        if entry.key not in reused:
            holders = sum(1 for r in chosen for e in r.shared_entries if e is entry)
            freed += blocks.blocks_freed_by(entry, holders)
    return freed


def choose_pixel_victims(wanted: Request, candidates: list[Request], running_pixels: int,
                         max_running_pixels: int) -> list[Request] | None:
    """The victims whose pixels, once freed, let `wanted` run under max_running_pixels (least urgent first), or
    None if preempting every candidate would not. Alone, any request runs: freeing every running one is enough."""
    chosen: list[Request] = []
    for victim in candidates:
        if running_pixels + wanted.pixels <= max_running_pixels:
            break
        chosen.append(victim)
        running_pixels -= victim.pixels
    if running_pixels and running_pixels + wanted.pixels > max_running_pixels:
        return None
    return chosen
