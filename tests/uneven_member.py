"""One member of a context-parallel group for test_uneven_split.py, run as a process of its own:
python tests/uneven_member.py RANK WORLD INIT_FILE OUT FAMILY=MODEL_PATH... For each model, at image/video token
counts a group of 2 does not divide, runs a forward alone and then split across the group (Ulysses over gloo),
and (rank 0) writes both outputs by (family, tokens) to OUT; at one token (fewer than the group) it records the
split's TooFewTokens, the forwards after it split as before."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from dvllm.models.loader import load_adapter
from dvllm.parallel.context_parallel import enable_context_parallel
from dvllm.parallel.uneven_split import TooFewTokens

TEXT = 7  # text tokens (Flux and Qwen-Image split them as well): odd too
# Image grids (rows x columns of tokens; Wan: frames x rows x columns): 1 token (fewer than the group) first, then
# the issue's 25 (dvllm's tiny Flux at 20x20) and 99 (diffusers' test components at 18x22), 21, 3
GRIDS = {"flux": [(1, 1), (5, 5), (9, 11), (3, 7), (1, 3)], "qwen": [(1, 1), (5, 5), (3, 7), (1, 3)],
         "wan": [(1, 1, 1), (1, 3, 3), (3, 3, 5), (1, 1, 3)]}


def inputs(family: str, transformer: torch.nn.Module, grid: tuple[int, ...]) -> dict:
    """A batch of 2 rows with `grid`'s image (or video) tokens, for the family's transformer."""
    g, config = torch.Generator().manual_seed(0), transformer.config
    if family == "wan":  # latents (B, C, frames, H, W); patches of 1x2x2
        f, h, w = grid
        return dict(hidden_states=torch.randn(2, config.in_channels, f, 2 * h, 2 * w, generator=g),
                    timestep=torch.tensor([300, 800]), return_dict=False,
                    encoder_hidden_states=torch.randn(2, TEXT, config.text_dim, generator=g))
    h, w = grid
    hidden = torch.randn(2, h * w, config.in_channels, generator=g)
    text = torch.randn(2, TEXT, config.joint_attention_dim, generator=g)
    if family == "flux":
        img_ids = torch.stack([torch.zeros(h * w), torch.arange(h * w) // w, torch.arange(h * w) % w], dim=1)
        return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.3, 0.8]),
                    pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=g),
                    img_ids=img_ids, txt_ids=torch.zeros(TEXT, 3), guidance=torch.full((2,), 3.5), return_dict=False)
    return dict(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=torch.ones(2, TEXT),
                timestep=torch.tensor([0.3, 0.8]), img_shapes=[[(1, h, w)]] * 2, return_dict=False)


def tokens(grid: tuple[int, ...]) -> int:
    n = 1
    for side in grid:
        n *= side
    return n


def main(rank: int, world: int, init_file: str, out: str, models: dict[str, str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for family, path in models.items():
        transformer = load_adapter(path, "auto", torch.device("cpu"), torch.float32).pipeline.transformer
        with torch.inference_mode():
            alone = [transformer(**inputs(family, transformer, grid))[0] for grid in GRIDS[family]]
        enable_context_parallel(transformer, world, 1, torch.device("cpu"))
        blocks = transformer.blocks if family == "wan" else transformer.transformer_blocks
        seen: list[int] = []  # the image tokens the last block gets: this member's slice
        blocks[-1].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((args or [kwargs.get("hidden_states")])[0].shape[1]),
            with_kwargs=True)
        for grid, whole in zip(GRIDS[family], alone):
            try:
                with torch.inference_mode():
                    split = transformer(**inputs(family, transformer, grid))[0]
            except TooFewTokens as e:
                results[(family, tokens(grid))] = {"refused": str(e)}
                continue
            results[(family, tokens(grid))] = {"alone": whole, "split": split, "block_tokens": seen[-1]}
        del transformer
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], dict(a.split("=", 1) for a in sys.argv[5:]))
    # As cp_member.py: leave without the teardown that now and then aborts after the work is saved
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
