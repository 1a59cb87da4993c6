"""Flux's IP-Adapter processor with per-row scales (image_prompts.py says how a forward's rows are chosen).

diffusers' FluxIPAdapterAttnProcessor runs in the double-stream blocks: the joint attention as the plain
processor runs it, then the image tokens' queries (normed, before the rotary embedding) attend to each image
prompt's tokens, and scale x that comes back as a third output, which the block adds to its hidden states after
its feed-forward. Here that third output is zeros but on the rows with an image prompt (x + 0 is x for the
others); a call with none of them returns the plain processor's two outputs, as without the adapter.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import _get_qkv_projections

from dvllm.worker.image_prompts import ImagePromptRows, RowTokens


class RowScaledFluxIPAttnProcessor(torch.nn.Module):
    def __init__(self, loaded: torch.nn.Module, plain: Any, rows: ImagePromptRows) -> None:
        super().__init__()
        self.to_k_ip, self.to_v_ip = loaded.to_k_ip, loaded.to_v_ip
        self._attention_backend, self._parallel_config = loaded._attention_backend, loaded._parallel_config
        plain._attention_backend, plain._parallel_config = self._attention_backend, self._parallel_config
        self.plain = plain
        self.rows = rows  # (a plain object: the projection it holds is not this module's)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: torch.Tensor | None = None) -> Any:
        current = None if encoder_hidden_states is None else self.rows.current()
        if current is None:
            return self.plain(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return self._with_images(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 current)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend, parallel_config=self._parallel_config)

    def _with_images(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                     attention_mask: torch.Tensor | None, image_rotary_emb: torch.Tensor | None, current: RowTokens
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As FluxIPAdapterAttnProcessor computes it, the image prompts' part on `current`'s rows only."""
        query, key, value, text_query, text_key, text_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
        key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
        value = value.unflatten(-1, (attn.heads, -1))
        image_query = query
        query = torch.cat([attn.norm_added_q(text_query.unflatten(-1, (attn.heads, -1))), query], dim=1)
        key = torch.cat([attn.norm_added_k(text_key.unflatten(-1, (attn.heads, -1))), key], dim=1)
        value = torch.cat([text_value.unflatten(-1, (attn.heads, -1)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self._attend(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        text_length = encoder_hidden_states.shape[1]
        text_out, out = out.split_with_sizes([text_length, out.shape[1] - text_length], dim=1)
        out = attn.to_out[1](attn.to_out[0](out))
        text_out = attn.to_add_out(text_out)

        rows = len(current.index)
        queries = image_query[current.index]
        image_out = torch.zeros_like(out)
        for tokens, to_k, to_v in zip(current.tokens, self.to_k_ip, self.to_v_ip):
            image_key = to_k(tokens).view(rows, -1, attn.heads, attn.head_dim)
            image_value = to_v(tokens).view(rows, -1, attn.heads, attn.head_dim)
            image = self._attend(queries, image_key, image_value).reshape(rows, -1, attn.heads * attn.head_dim)
            image_out = self.rows.add(image_out, current, image.to(queries.dtype))
        return out, text_out, image_out
