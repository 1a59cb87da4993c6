"""Pool entries requests share (a text's conditions, a control image): the one admitted first fills it, and a
request that reads one its writer left unfilled (its encode or its swap-in failed) fails too, rather than
denoise from unwritten blocks."""
from __future__ import annotations

from typing import Any


def written_entries(blocks: Any) -> list[tuple[int, ...]]:
    """The shared blocks a request was to fill this iteration (cache misses), by their block ids."""
    out = [tuple(blocks.cond)] if blocks.write_cond else []
    if blocks.uncond is not None and blocks.write_uncond:
        out.append(tuple(blocks.uncond))
    out += [tuple(entry) for entry, write in zip(blocks.controls, blocks.write_controls) if write]
    return out


def fail_readers(admitted: list[Any], unwritten: dict[tuple[int, ...], str], errors: dict[str, str]) -> None:
    """Fails each request admitted this iteration that reads an entry in `unwritten` (blocks -> why)."""
    if not unwritten:
        return
    for data in admitted:
        tables = data.blocks
        texts = [tuple(tables.cond)] + ([tuple(tables.uncond)] if tables.uncond is not None else [])
        bad = next((b for b in texts if b in unwritten), None)
        what = "its prompt embedding"
        if bad is None:
            bad, what = next((tuple(b) for b in tables.controls if tuple(b) in unwritten), None), "its control image"
        if bad is not None and data.request_id not in errors:
            errors[data.request_id] = f"{what} could not be written: {unwritten[bad]}"
