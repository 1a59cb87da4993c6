"""A CLIP tokenizer whose words are the caption vocabulary: each word one token.

CLIP's BPE splits a word into characters and merges pairs by rank; giving every
vocabulary word the chain of merges that rebuilds it makes it a single token. Any
other text still tokenizes, character by character (every byte is in the vocabulary).
"""
from __future__ import annotations

import json
import os

from transformers import CLIPTokenizer, PreTrainedTokenizerFast

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


def write_t5_tokenizer(folder: str, words: list[str], model_max_length: int = 32) -> PreTrainedTokenizerFast:
    """A T5-style tokenizer (pad 0, eos 1, unk 2, "</s>" appended) whose tokens are the given words, for the
    video model's UMT5 encoder; AutoTokenizer loads the folder. Other words are <unk>."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=model_max_length)
    fast.save_pretrained(folder)
    return fast
