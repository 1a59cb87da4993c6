"""Rows of their own image shapes in one Qwen-Image transformer call.

The transformer computes one set of rotary positions for the whole batch, from the first row's image
shapes (diffusers warns when rows differ). Edits whose input images differ in size differ in those
shapes and in sequence length. `rows_of_own_shapes` lets them share a call: each row's image tokens
are padded to the longest row's, its rotary positions are computed from its own shapes, and the
attention masks the padding out. Padding rather than packing keeps every row a row (the modulation,
the norms and the LoRA layers stay per row), and the padding costs only the difference between the
longest and the other rows' image tokens.

Two hooks in diffusers' hook registry, installed once on the transformer (`RowShapeHooks`) and passing every
call through unless a call's row shapes are given to them for its span (`running`): one on the transformer's
`pos_embed`, which returns per-row frequencies, and one on each block's attention, which runs the row
attention processor: it applies them row by row and masks padded image tokens, computing what diffusers'
QwenDoubleStreamAttnProcessor2_0 does for one row. Nothing of the transformer is swapped for the call.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention_dispatch import dispatch_attention_fn

HOOK_NAME = "dvllm_row_shapes"


@dataclass(frozen=True)
class RowShapes:
    """One call's rows: each row's img_shapes, the padded image tokens, and which of them are real [rows, tokens]."""

    shapes: list[list[tuple[int, int, int]]]
    tokens: int
    image_mask: torch.Tensor


class _PositionsHook(ModelHook):
    """On the transformer's pos_embed: (image freqs [rows, tokens, d], text freqs [rows, text, d]), each row's
    from its own shapes, while a call's RowShapes are given."""

    def __init__(self) -> None:
        super().__init__()
        self.context: RowShapes | None = None

    def new_forward(self, module: torch.nn.Module, img_shapes: Any, *args: Any, **kwargs: Any) -> Any:
        original, rows = self.fn_ref.original_forward, self.context
        if rows is None:
            return original(img_shapes, *args, **kwargs)
        done: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        images, texts = [], []
        for shapes in rows.shapes:
            key = tuple(shapes)
            if key not in done:
                done[key] = original([shapes], *args, **kwargs)
            image, text = done[key]
            pad = image.new_ones(rows.tokens - len(image), image.shape[-1])  # rotation by 0: masked anyway
            images.append(torch.cat([image, pad]))
            texts.append(text)
        return torch.stack(images), torch.stack(texts)


class _AttentionHook(ModelHook):
    """On a block's attention: the row attention, masking padded image tokens, while a call's RowShapes are
    given."""

    def __init__(self) -> None:
        super().__init__()
        self.context: RowShapes | None = None
        self.processor = RowAttentionProcessor()

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        rows = self.context
        if rows is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        return self.processor(module, *args, image_mask=rows.image_mask, **kwargs)


class RowAttentionProcessor:
    """Joint text-image attention with per-row rotary frequencies and a mask of real image tokens."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: Any = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = attn.inner_dim // attn.heads
        image = [p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        text = [p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        for stream, (norm_q, norm_k) in ((image, (attn.norm_q, attn.norm_k)),
                                         (text, (attn.norm_added_q, attn.norm_added_k))):
            if norm_q is not None:
                stream[0] = norm_q(stream[0])
            if norm_k is not None:
                stream[1] = norm_k(stream[1])
        image_freqs, text_freqs = image_rotary_emb
        for stream, freqs in ((image, image_freqs), (text, text_freqs)):
            stream[0], stream[1] = _rotate(stream[0], freqs), _rotate(stream[1], freqs)
        rows, text_len = encoder_hidden_states.shape[:2]
        if encoder_hidden_states_mask is None:
            encoder_hidden_states_mask = torch.ones(rows, text_len, dtype=torch.bool, device=hidden_states.device)
        mask = torch.cat([encoder_hidden_states_mask.bool(), image_mask], dim=1)[:, None, None, :]
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(text, image))  # [rows, tokens, heads, d]
        # diffusers' dispatch, as its own processor calls it: the engine's attention backend (attention_backend.py)
        out = dispatch_attention_fn(query, key, value, attn_mask=mask).flatten(2, 3)
        out = out.to(query.dtype)
        image_out = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text_len].contiguous())


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [rows, tokens, heads, d] by complex freqs [rows, tokens, d / 2], each row by its own."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


class RowShapeHooks:
    """The two hooks on one transformer; a call's RowShapes are given to them for its span."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self._hooks: list[_PositionsHook | _AttentionHook] = []
        self._add(transformer.pos_embed, _PositionsHook())
        for block in transformer.transformer_blocks:
            self._add(block.attn, _AttentionHook())

    def _add(self, module: torch.nn.Module, hook: ModelHook) -> None:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        self._hooks.append(hook)

    @contextmanager
    def running(self, rows: RowShapes) -> Iterator[None]:
        for hook in self._hooks:
            hook.context = rows
        try:
            yield
        finally:
            for hook in self._hooks:
                hook.context = None
