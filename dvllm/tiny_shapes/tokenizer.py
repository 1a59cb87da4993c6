"""A CLIP tokenizer whose words are the caption vocabulary: each word one token.

CLIP's BPE splits a word into characters and merges pairs by rank; giving every
vocabulary word the chain of merges that rebuilds it makes it a single token. Any
other text still tokenizes, character by character (every byte is in the vocabulary).
"""
from __future__ import annotations

import json
import os

from transformers import CLIPTokenizer

from dvllm.models.byte_tokenizer import BOS, EOS, _byte_alphabet
from dvllm.tiny_shapes.data import vocabulary

MAX_LENGTH = 16  # captions are short: a shorter context makes a smaller, faster text encoder


def write_tokenizer(folder: str) -> CLIPTokenizer:
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in vocabulary():
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if (current, piece) not in merges:
                merges.append((current, piece))
            if merged not in tokens:
                tokens.append(merged)
            current = merged
    tokens += [BOS, EOS]
    os.makedirs(folder, exist_ok=True)
    vocab_file, merges_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w") as f:
        json.dump({t: i for i, t in enumerate(tokens)}, f)
    with open(merges_file, "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(vocab_file, merges_file, model_max_length=MAX_LENGTH, pad_token=EOS)
    tokenizer.save_pretrained(folder)
    return tokenizer
