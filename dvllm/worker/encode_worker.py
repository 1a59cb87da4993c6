"""Encode workers (EngineConfig.encode_workers): processes of their own, each holding a copy of the model's text
encoders on the CPU or another GPU, that encode the encode stage's texts, so that neither the text encoders nor
their tokenizers run in the worker's process (its GIL) or, on GPUs, on its device, and the worker holds no text
encoder weights at all: its own are sent to the meta device once copied (their configs stay, for what reads
them).

The encode stage gives each process a lane (a thread that sends it a batch of texts and waits for their
conditions). The process (stage_process.py) builds, from `EncoderCopy`, the family's pipeline with its text
encoders, tokenizers and processors and no denoiser or VAE, and the family's adapter around it, whose own
`encode_prompt` runs on it: the conditions are those the worker's encoders would have made. The copy stays on
the host for the engine's life, so a process that dies can be started again; its batch is encoded once more.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from dvllm.runtime.channel import Channel
from dvllm.worker.conditions import encode_flat
from dvllm.worker.stage_process import StageProcess, check_devices, serve

logger = logging.getLogger(__name__)

# What the worker keeps of the adapter for the process: not its pipeline (rebuilt there), nor the hooks on its
# denoiser (Qwen edits' row shapes)
_NOT_COPIED = ("pipeline", "_row_hooks", "vae_lock")  # (the process has no VAE: the lock stays with it)


def _copied(value: Any) -> bool:
    """Whether an adapter attribute goes to the encode process: plain data does (its name, dtype, ModelInfo);
    modules (Wan's experts: a transformer's weights, quantized ones unpicklable) and the methods a worker group
    wraps on the instance (denoise, decode) stay: encode_prompt reads neither."""
    if callable(value) or isinstance(value, torch.nn.Module):
        return False
    return not (isinstance(value, (list, tuple)) and any(isinstance(v, torch.nn.Module) for v in value))


@dataclass
class ModuleCopy:
    """A module as plain data: its class, config, mode, and every parameter and buffer on the host (a tied
    weight under each of its names, as one tensor)."""

    cls: type
    config: Any
    tensors: dict[str, torch.Tensor]
    parameters: frozenset[str]
    training: bool

    @classmethod
    def of(cls, name: str, module: torch.nn.Module) -> ModuleCopy:
        parameters = dict(module.named_parameters(remove_duplicate=False))
        tensors: dict[str, torch.Tensor] = {}
        host: dict[int, torch.Tensor] = {}  # one copy per tensor, whatever names tie it
        for key, tensor in {**parameters, **dict(module.named_buffers(remove_duplicate=False))}.items():
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                raise ValueError(f"encode_workers: {name}'s {key} is a {type(tensor).__name__}, not a plain tensor (a "
                                 "quantized text encoder?); encode workers copy plain weights only")
            if id(tensor) not in host:
                host[id(tensor)] = tensor.detach().to("cpu", copy=True)
            tensors[key] = host[id(tensor)]
        return cls(type(module), module.config, tensors, frozenset(parameters), module.training)

    def build(self, device: torch.device) -> torch.nn.Module:
        with torch.device("meta"):  # the structure only: every tensor is the copy's
            module = self.cls(self.config)
        made: dict[int, torch.Tensor] = {}
        for key, tensor in self.tensors.items():
            owner, _, leaf = key.rpartition(".")
            parent = module.get_submodule(owner)
            if key in self.parameters:
                if id(tensor) not in made:
                    made[id(tensor)] = torch.nn.Parameter(tensor, requires_grad=False)
                parent._parameters[leaf] = made[id(tensor)]
            else:
                parent._buffers[leaf] = tensor
        missing = [key for key, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if missing:
            raise RuntimeError(f"{self.cls.__name__} built without {missing[:3]}")
        return module.to(device).train(self.training)


@dataclass
class EncoderCopy:
    """What an adapter's encode_prompt reads, as plain data a process rebuilds it from: the text encoders, the
    pipeline's other parts that are not modules (tokenizers, processors, scheduler), and the adapter's own
    attributes (its ModelInfo among them)."""

    adapter_cls: type
    pipeline_cls: type
    encoders: dict[str, ModuleCopy]
    parts: dict[str, Any]
    # the modules the process does without (denoiser, VAE, image encoders) -> their configs: each is passed as None,
    # then stands in as its config alone (SD3 without T5 sizes its zero T5 embeddings by the transformer's config)
    absent: dict[str, Any]
    attributes: dict[str, Any]

    @classmethod
    def of(cls, adapter: Any) -> EncoderCopy:
        adapter.info  # noqa: B018 - made here (it reads the denoiser's config), and copied with the attributes
        encoders, parts, absent = {}, {}, {}
        for name, component in adapter.pipeline.components.items():
            if isinstance(component, torch.nn.Module):
                if is_text_encoder(name):
                    encoders[name] = ModuleCopy.of(name, component)
                else:
                    absent[name] = getattr(component, "config", None)
            else:
                parts[name] = component
        attributes = {k: v for k, v in vars(adapter).items() if k not in _NOT_COPIED and _copied(v)}
        for key, value in attributes.items():
            try:
                pickle.dumps(value)
            except Exception as e:  # noqa: BLE001 - named in the refusal
                raise ValueError(f"encode_workers: the {adapter.info.family} adapter's {key} cannot be sent to a "
                                 f"process ({type(e).__name__}: {e})") from None
        return cls(type(adapter), type(adapter.pipeline), encoders, parts, absent, attributes)

    def build(self, device: torch.device) -> Any:
        components = {**dict.fromkeys(self.absent), **self.parts,
                      **{name: copy.build(device) for name, copy in self.encoders.items()}}
        adapter = object.__new__(self.adapter_cls)  # the family's adapter, without its __init__ (which reads the
        vars(adapter).update(self.attributes)  # denoiser): its attributes as the worker's has them
        adapter.pipeline = self.pipeline_cls(**components)
        for name, config in self.absent.items():
            if config is not None:
                setattr(adapter.pipeline, name, ConfigOnly(config))
        adapter.device = adapter.encoder_device = device
        return adapter


@dataclass(frozen=True)
class ConfigOnly:
    """A module the encode process does without, as much of it as encoding reads: its config."""

    config: Any


def is_text_encoder(name: str) -> bool:
    return name.startswith("text_encoder")


def release_text_encoders(adapter: Any) -> None:
    """Frees the worker's own text encoders (encode workers hold theirs): to the meta device, so their configs
    stay for what reads them, and anything that would run them fails at once."""
    for name, component in adapter.pipeline.components.items():
        if is_text_encoder(name) and isinstance(component, torch.nn.Module):
            component.to("meta")


# A batch: (texts, max_sequence_length, the images an edit model reads them with) -> flat conditions on the host
Batch = tuple[list[tuple[str | None, bool]], "int | None", Any]


class EncodeWorker(StageProcess):
    """One encode process: gets its encoder copy with the first batch, answers each with its texts' conditions
    flattened, [texts, numel], on the host."""

    kind = "encode"
    target = "dvllm.worker.encode_worker:main"
    process_name = "dvllm-encode"

    def encode(self, batch: Batch) -> torch.Tensor:
        return self.call(batch)


def _encode_batch(adapter: Any, batch: Batch, device: torch.device) -> torch.Tensor:
    texts, length, images = batch
    return encode_flat(adapter, texts, length, images).cpu()


def start_encode_workers(adapter: Any, count: int, devices: list[str], worker_device: torch.device
                         ) -> list[EncodeWorker]:
    """`count` encode processes placed in turn on `devices` (those this process sees), none on a GPU worker's
    own GPU; then frees the worker's text encoders."""
    check_devices(devices, worker_device, "encode_device", "on its own GPU the encode stage's thread encodes")
    copy = EncoderCopy.of(adapter)
    release_text_encoders(adapter)
    # As many intra-op threads as the worker's: the CPU's kernels split their sums by the thread count, and
    # conditions must not depend on the process that encoded them
    threads = torch.get_num_threads()
    logger.info("%d encode worker process(es) on %s", count, ", ".join(devices))
    return [EncodeWorker(lambda: copy, devices[i % len(devices)], threads, i) for i in range(count)]


def main(channel: Channel, device: str) -> None:
    """The process's target (dvllm.runtime.spawn)."""
    serve(channel, device, lambda copy, device: copy.build(device), _encode_batch)
