"""Rows of their own image shapes in one Qwen-Image transformer call.

The transformer computes one set of rotary positions for the whole batch, from the first row's image
shapes (diffusers warns when rows differ). Edits whose input images differ in size differ in those
shapes and in sequence length. `rows_of_own_shapes` lets them share a call: each row's image tokens
are padded to the longest row's, its rotary positions are computed from its own shapes, and the
attention masks the padding out. Padding rather than packing keeps every row a row (the modulation,
the norms and the LoRA layers stay per row), and the padding costs only the difference between the
longest and the other rows' image tokens.

Two pieces, installed for the one call: a stand-in for the transformer's `pos_embed` that returns
per-row frequencies, and an attention processor that applies them row by row and masks padded image
tokens. The processor computes what diffusers' QwenDoubleStreamAttnProcessor2_0 does for one row.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn


class _RowPositions(torch.nn.Module):
    """The transformer's pos_embed, per row: (image freqs [rows, tokens, d], text freqs [rows, text, d])."""

    def __init__(self, pos_embed: torch.nn.Module, shapes: list[list[tuple[int, int, int]]], tokens: int) -> None:
        super().__init__()
        self.pos_embed, self.shapes, self.tokens = pos_embed, shapes, tokens

    def forward(self, img_shapes: Any, max_txt_seq_len: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
        done: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        images, texts = [], []
        for shapes in self.shapes:
            key = tuple(shapes)
            if key not in done:
                done[key] = self.pos_embed([shapes], max_txt_seq_len=max_txt_seq_len, device=device)
            image, text = done[key]
            pad = image.new_ones(self.tokens - len(image), image.shape[-1])  # rotation by 0: masked anyway
            images.append(torch.cat([image, pad]))
            texts.append(text)
        return torch.stack(images), torch.stack(texts)


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


@contextmanager
def rows_of_own_shapes(transformer: Any, shapes: list[list[tuple[int, int, int]]], tokens: int,
                       image_mask: torch.Tensor) -> Iterator[dict[str, Any]]:
    """For one transformer call: per-row positions and the row attention; yields its attention_kwargs."""
    processors, pos_embed = transformer.attn_processors, transformer.pos_embed
    transformer.pos_embed = _RowPositions(pos_embed, shapes, tokens)
    transformer.set_attn_processor(RowAttentionProcessor())
    try:
        yield {"image_mask": image_mask}
    finally:
        transformer.pos_embed = pos_embed
        transformer.set_attn_processor(processors)
