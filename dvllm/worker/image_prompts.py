"""IP-Adapter image prompts per request, inside one denoiser forward.

diffusers sets one scale per adapter on every IP-Adapter attention processor (`set_ip_adapter_scale`) and feeds
every row of a call the same adapter. Here each forward's rows differ: some have an image prompt, at their own
scale, others none. A forward's ImagePromptPlan lists the rows with one (a CFG request's unconditional rows
with its unconditional embeds, as the pipeline's prepare_ip_adapter_image_embeds lays them out), their image
embeds and their scales. The adapter's image projection runs once per forward on those rows (memoized in the
forward's context); each IP-Adapter attention processor then adds, on those rows only, scale x the attention of
their queries over their image tokens, as diffusers' processors add it (hidden + scale * ip). A row without an
image prompt is not touched, so it is computed as without the adapter; a forward with no image prompt (context
None: a plain, compiled or captured forward) runs the plain processors' code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dvllm.host_copy import device_index, to_device
from dvllm.models.layout import BatchLayout
from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks
from dvllm.worker.request_state import RequestState


@dataclass
class ImagePromptPlan:
    rows: list[int]        # the forward's rows with an image prompt, ascending
    index: torch.Tensor    # the same on the device
    embeds: torch.Tensor   # [rows, 1, ...] their image embeds (the projection's input, one image per row)
    scales: list[float]    # their requests' ip_adapter_scale


def image_prompt_plan(states: list[RequestState], layout: BatchLayout, embed: Any,
                      device: torch.device) -> ImagePromptPlan | None:
    """This forward's image-prompt rows (None: none). `states` in the layout's request order; `embed(state)`:
    the request's (conditional, unconditional) embeds, each [1, ...]."""
    members: list[tuple[int, torch.Tensor, float]] = []
    for request, state in enumerate(states):
        prompt = state.data.image_prompt
        if prompt is None or prompt.scale == 0.0:  # (diffusers skips an adapter of scale 0)
            continue
        cond_embeds, uncond_embeds = embed(state)
        cond, uncond = layout.request_rows(request)
        members += [(row, cond_embeds, prompt.scale) for row in cond]
        members += [(row, uncond_embeds, prompt.scale) for row in uncond]
    if not members:
        return None
    members.sort(key=lambda m: m[0])
    rows = [row for row, _, _ in members]
    return ImagePromptPlan(rows, device_index(rows, device), torch.cat([e for _, e, _ in members]).unsqueeze(1),
                           [s for _, _, s in members])


@dataclass
class RowTokens:
    """What one attention call adds to: positions in its batch, the image tokens of those rows, their scales."""

    index: torch.Tensor
    tokens: list[torch.Tensor]  # per adapter, [rows, tokens, dim]
    scales: torch.Tensor        # [rows, 1, 1] float32


class ImagePromptRows:
    """Gives the IP-Adapter processors the forward's image-prompt rows (ForwardHooks gives it each forward's
    context; a context without an ImagePromptPlan leaves every processor plain)."""

    def __init__(self, projection: Callable[[list[torch.Tensor]], list[torch.Tensor]], hooks: ForwardHooks) -> None:
        self.context: ForwardContext | None = None
        self.projection = projection  # the adapter's image projection (MultiIPAdapterImageProjection)
        hooks.add(DENOISER, self)

    def current(self) -> RowTokens | None:
        """The rows of the call running now that have an image prompt (None: none)."""
        context = self.context
        plan = None if context is None else context.image_prompt
        if plan is None:
            return None
        running = context.rows.rows
        key = ("image_prompt", None if running is None else tuple(running))
        held = context.memo.get(key)
        if held is None:
            held = context.memo[key] = self._tokens(context, plan, running)
        return held or None

    def _tokens(self, context: ForwardContext, plan: ImagePromptPlan, running: list[int] | None
                ) -> RowTokens | bool:
        projected = context.memo.get("image_prompt_projected")
        if projected is None:  # [rows, 1, tokens, dim] per adapter: one image per row
            projected = context.memo["image_prompt_projected"] = [p[:, 0] for p in self.projection([plan.embeds])]
        device = plan.index.device
        if running is None:
            index, picked, scales = plan.index, projected, plan.scales
        else:  # a call on some rows (step caching, per-shape calls): its positions of the plan's rows
            at = {row: place for place, row in enumerate(running)}
            keep = [i for i, row in enumerate(plan.rows) if row in at]
            if not keep:
                return False
            index = device_index([at[plan.rows[i]] for i in keep], device)
            chosen = device_index(keep, device)
            picked, scales = [p[chosen] for p in projected], [plan.scales[i] for i in keep]
        # float32, as a Python float multiplies a half-precision tensor in diffusers' processors
        return RowTokens(index, picked, to_device(torch.tensor(scales, dtype=torch.float32).view(-1, 1, 1), device))

    def add(self, total: torch.Tensor, current: RowTokens, image: torch.Tensor) -> torch.Tensor:
        """`total` + scale x `image` on `current`'s rows (`image`: theirs), the others as they are."""
        return total.index_add(0, current.index, (current.scales * image).to(image.dtype))


class RowScaledIPAttnProcessor(torch.nn.Module):
    """A UNet cross-attention's IP-Adapter processor with per-row scales: diffusers' IPAdapterAttnProcessor2_0's
    keys and values of the image tokens (its to_k_ip / to_v_ip, loaded by load_ip_adapter), its rows chosen by
    the forward; the text attention is the plain processor's."""

    def __init__(self, loaded: torch.nn.Module, plain: Any, rows: ImagePromptRows) -> None:
        super().__init__()
        self.to_k_ip, self.to_v_ip = loaded.to_k_ip, loaded.to_v_ip
        self.plain = plain
        self.rows = rows  # (a plain object: the projection it holds is not this module's)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        current = self.rows.current()
        if current is None:
            return self.plain(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        return self._with_images(attn, hidden_states, encoder_hidden_states, attention_mask, temb, current)

    def _with_images(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, temb: torch.Tensor | None, current: RowTokens
                     ) -> torch.Tensor:
        """As IPAdapterAttnProcessor2_0 computes it, the image part on `current`'s rows only."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (hidden_states.shape if encoder_hidden_states is None
                                          else encoder_hidden_states.shape)
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def heads(x: torch.Tensor, rows: int) -> torch.Tensor:
            return x.view(rows, -1, attn.heads, head_dim).transpose(1, 2)

        def merged(x: torch.Tensor, rows: int) -> torch.Tensor:
            return x.transpose(1, 2).reshape(rows, -1, attn.heads * head_dim).to(query.dtype)

        query = heads(query, batch_size)
        out = sdpa(query, heads(key, batch_size), heads(value, batch_size), attn_mask=attention_mask, dropout_p=0.0,
                   is_causal=False)
        hidden_states = merged(out, batch_size)
        rows = len(current.index)
        image_query = query[current.index]
        for tokens, to_k, to_v in zip(current.tokens, self.to_k_ip, self.to_v_ip):
            image = merged(sdpa(image_query, heads(to_k(tokens), rows), heads(to_v(tokens), rows), attn_mask=None,
                                dropout_p=0.0, is_causal=False), rows)
            hidden_states = self.rows.add(hidden_states, current, image)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor
