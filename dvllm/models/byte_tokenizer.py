"""A CLIP tokenizer over single bytes, made from no files at all.

Presets and tests need a real CLIPTokenizer without downloading CLIP's 49k-token
vocabulary. Every byte (in CLIP's byte-to-unicode alphabet) is a token, with and
without the end-of-word mark, and there are no merges: any text tokenizes.
"""
from __future__ import annotations

import json
import os
import tempfile

from transformers import CLIPTokenizer, PreTrainedTokenizerFast

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


def byte_t5_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """A T5-style tokenizer (pad 0, eos 1, unk 2, one token per byte, </s> appended) from no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for char in _byte_alphabet():
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=model_max_length)


def byte_qwen_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """A Qwen-style chat tokenizer (byte-level, <|im_start|>/<|im_end|> as single tokens) from no files."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {char: i for i, char in enumerate(_byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    qwen = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=specials[1:], model_max_length=model_max_length)
    qwen.chat_template = CHAT_TEMPLATE
    return qwen


# The ChatML layout Qwen's tokenizers use (Z-Image formats prompts with it).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
