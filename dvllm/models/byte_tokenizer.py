"""A CLIP tokenizer over single bytes, made from no files at all.

Presets and tests need a real CLIPTokenizer without downloading CLIP's 49k-token
vocabulary. Every byte (in CLIP's byte-to-unicode alphabet) is a token, with and
without the end-of-word mark, and there are no merges: any text tokenizes.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from transformers import CLIPTokenizer, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformers import Qwen2VLProcessor

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


# Qwen2.5-VL's preprocessor_config.json (Qwen-Image-Edit's processor folder has the same).
QWEN_VL_IMAGE_PROCESSOR = dict(
    min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
)


def byte_qwen_vl_processor(vision_start_token_id: int = 151652, vision_end_token_id: int = 151653,
                           image_token_id: int = 151655, video_token_id: int = 151656,
                           model_max_length: int = 131072, **image_processor_kwargs: Any) -> Qwen2VLProcessor:
    """A Qwen2-VL processor from no files, as Qwen-Image-Edit's pipelines use: byte_qwen_tokenizer's tokens plus
    <|vision_start|>, <|vision_end|>, <|image_pad|> and <|video_pad|>, each a single token at the id given (they
    must match the text encoder config's vision_start_token_id, image_token_id and video_token_id; the defaults
    are Qwen2.5-VL's, for its vocabulary of 152064), and Qwen2.5-VL's image processor (QWEN_VL_IMAGE_PROCESSOR,
    updated by image_processor_kwargs). A video processor only where torchvision is installed: see
    allow_qwen_vl_processor_without_torchvision."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    allow_qwen_vl_processor_without_torchvision()
    vision = {"<|vision_start|>": vision_start_token_id, "<|vision_end|>": vision_end_token_id,
              "<|image_pad|>": image_token_id, "<|video_pad|>": video_token_id}
    tokenizer = _byte_qwen_vl_tokenizer(vision, model_max_length)
    image_processor = _qwen_vl_image_processor_class()(**{**QWEN_VL_IMAGE_PROCESSOR, **image_processor_kwargs})
    video = {}
    if is_torchvision_available():  # then transformers requires one
        from transformers import Qwen2VLVideoProcessor

        video["video_processor"] = Qwen2VLVideoProcessor()
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, **video)


def _byte_qwen_vl_tokenizer(vision: dict[str, int], model_max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # byte_qwen_tokenizer's ids for its own specials, so both tokenize text alike
    specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, **vision}
    if len(set(vision.values())) != len(vision) or min(vision.values()) <= 258:
        raise ValueError(f"vision token ids must be distinct and above 258 (the bytes and chat tokens): {vision}")
    # A special token already in the model's vocabulary keeps that id when added, so the specials sit in the
    # vocabulary at their ids; unused entries (which no text reaches: there are no merges) fill the gaps.
    by_id = dict(enumerate(_byte_alphabet())) | {i: token for token, i in specials.items()}
    vocab = {by_id.get(i, f"<|unused_{i}|>"): i for i in range(max(by_id) + 1)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    qwen = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=list(specials)[1:], model_max_length=model_max_length)
    qwen.chat_template = CHAT_TEMPLATE
    return qwen


def _qwen_vl_image_processor_class() -> type:
    """Qwen2VLImageProcessor, or its PIL twin where torchvision is missing (the same saved config, and no warning)."""
    import transformers
    from transformers.utils import is_torchvision_available

    # by name: merely importing Qwen2VLImageProcessor without torchvision logs that warning
    return getattr(transformers, "Qwen2VLImageProcessor" if is_torchvision_available() else "Qwen2VLImageProcessorPil")


def allow_qwen_vl_processor_without_torchvision() -> None:
    """Lets a Qwen2VLProcessor be built, saved and loaded (Qwen2VLProcessor.from_pretrained, and so
    DiffusionPipeline.from_pretrained) with no video processor where torchvision is missing.

    transformers 5 makes every Qwen2-VL processor hold a video processor, and video processors need torchvision,
    which does not import beside the pinned CPU torch (requirements/cpu.txt). The Qwen-Image-Edit pipelines pass
    images only. Without torchvision this drops the video processor from Qwen2VLProcessor's attributes, so nothing
    builds, checks, saves or loads one (and videos passed to the processor are ignored: no pixel values come back).
    A process must call it before it loads such a folder. With torchvision it does nothing. Idempotent."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(Qwen2VLProcessor, "_dvllm_without_video", False):
        return
    attributes = Qwen2VLProcessor.get_attributes.__func__

    def without_video(cls) -> list[str]:
        return [name for name in attributes(cls) if name != "video_processor"]

    Qwen2VLProcessor.get_attributes = classmethod(without_video)
    Qwen2VLProcessor._dvllm_without_video = True
