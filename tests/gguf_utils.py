"""GGUF files made in the tests with the gguf package (llama.cpp's writer), as a user's converter would: a
model's state dict in diffusers' key layout, its Linear weights quantized where their rows fit whole blocks."""
from __future__ import annotations

import torch


def write_gguf(model: torch.nn.Module, path: str, qtype_name: str = "Q8_0") -> int:
    """Writes `model` to `path`; returns how many tensors were quantized (the rest stay F32)."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(path, arch="dvllm-test")
    quantized = 0
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if array.ndim == 2 and array.shape[-1] % block == 0:  # a Linear weight whose rows split into blocks
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
            quantized += 1
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized
