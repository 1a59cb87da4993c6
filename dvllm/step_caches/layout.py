"""A family's transformer as step caching sizes a row's state from it (no torch: the driver sizes with it). The
config a method sizes is a CacheConfig (step_cache.py), not named here: it is made from this package's registry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheLayout:
    """A family's transformer, as much as the driver needs to size one row's cache state.

    Tokens: `image` (one per latent patch), `text` (the prompt's: `text_tokens_for`), `joint` (text then
    image, as one sequence), `unified` (image then text,
    each padded to a multiple of `token_multiple`: Z-Image's single stream). `hidden_kind` is the blocks'
    hidden stream (what first_block keeps); `attention_outputs` lists the token kind of every output of
    every attention module TaylorSeer predicts, in order.
    """

    inner_dim: int
    pixels_per_token: int  # along each side: the VAE's scale times the transformer's patch
    attention_outputs: tuple[str, ...]
    text_tokens: int | None = None
    element_bytes: int = 4  # of the state pool (the model's dtype)
    hidden_kind: str = "image"
    token_multiple: int = 1
    # Byte-level BPE text (Qwen-Image): a text has at most one token per UTF-8 byte, plus this many of the
    # pipeline's template (its bytes less the tokens it drops); the state keeps no more text tokens than
    # that (the worker checks it).
    text_bytes_extra: int | None = None
    # Video (Wan): image tokens are per latent frame, the VAE keeping the first frame and packing each
    # temporal_scale after it into one. 0: images.
    temporal_scale: int = 0

    def text_tokens_for(self, max_sequence_length: int | None, texts: tuple[str | None, ...]) -> int:
        """Text tokens a request's state keeps per text output: the family's fixed length, or its
        max_sequence_length, bounded by its longest text where the tokenizer allows."""
        if self.text_tokens:
            return self.text_tokens
        tokens = max_sequence_length or 0
        if self.text_bytes_extra is not None:
            longest = max(len((t or "").encode("utf-8")) for t in texts)
            tokens = min(tokens, longest + self.text_bytes_extra)
        return tokens

    def image_tokens(self, height: int, width: int, frames: int | None = None) -> int:
        plane = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return plane * ((max(frames or 1, 1) - 1) // self.temporal_scale + 1 if self.temporal_scale else 1)

    def tokens(self, kind: str, height: int, width: int, text: int, frames: int | None = None) -> int:
        image = self.image_tokens(height, width, frames)
        if kind == "unified":
            return _round_up(image, self.token_multiple) + _round_up(text, self.token_multiple)
        return {"image": image, "text": text, "joint": text + image}[kind]

    def request_row(self, config: Any, height: int, width: int, max_sequence_length: int | None,
                    texts: tuple[str | None, ...], frames: int | None = None) -> tuple[int, int]:
        """A request's text tokens kept per text stream, and the pool elements one of its rows takes."""
        text_tokens = self.text_tokens_for(max_sequence_length, texts)
        return text_tokens, self.row_numel(config, height, width, text_tokens, frames)

    def row_numel(self, config: Any, height: int, width: int, text_tokens: int,
                  frames: int | None = None) -> int:
        """Pool elements one model row's cache state takes (text_tokens: `text_tokens_for` the request), as
        the config's method sizes it."""
        return config.spec.row_numel(config, self, lambda kind: self.tokens(kind, height, width, text_tokens, frames))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
