"""A CLIP tokenizer over single bytes, made from no files at all.

Presets and tests need a real CLIPTokenizer without downloading CLIP's 49k-token
vocabulary. Every byte (in CLIP's byte-to-unicode alphabet) is a token, with and
without the end-of-word mark, and there are no merges: any text tokenizes.
"""
from __future__ import annotations

import json
import os
import tempfile

from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_vocab() -> dict[str, int]:
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + [BOS, EOS]
    return {token: i for i, token in enumerate(tokens)}


def byte_clip_tokenizer(model_max_length: int = 77, pad_token: str = EOS) -> CLIPTokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        with open(vocab, "w") as f:
            json.dump(byte_vocab(), f)
        with open(merges, "w") as f:
            f.write("#version: 0.2\n")
        return CLIPTokenizer(vocab, merges, model_max_length=model_max_length, pad_token=pad_token)
