"""--quantization: a user's spec -> diffusers' PipelineQuantizationConfig (weights quantized as they load).

Spec forms: `BACKEND[:OPTION]` (torchao:int8wo, torchao:float8wo, bitsandbytes:nf4, quanto:int8, ...) for the
denoiser, or JSON `{"backend": ..., "options": {...}, "components": [...]}` for the backend's own options and
other components. Checked once, when the engine config is made: backend, package, options (by building
diffusers' config for it); the components against the model when it loads.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

# backend -> the pip package it needs and the module that package installs
PACKAGES = {"torchao": ("torchao", "torchao"), "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
            "quanto": ("optimum-quanto", "optimum.quanto")}
TORCHAO_TYPES = {  # short names -> torchao.quantization config classes
    "int8wo": "Int8WeightOnlyConfig", "int8dq": "Int8DynamicActivationInt8WeightConfig",
    "int4wo": "Int4WeightOnlyConfig", "float8wo": "Float8WeightOnlyConfig",
    "float8dq": "Float8DynamicActivationFloat8WeightConfig",
}
SHORT_OPTIONS: dict[str, dict[str, dict[str, Any]]] = {  # backend -> OPTION -> options; the first is the default
    "torchao": {name: {"quant_type": name} for name in TORCHAO_TYPES},
    "bitsandbytes": {"4bit": {"load_in_4bit": True}, "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "8bit": {"load_in_8bit": True}},
    "quanto": {dtype: {"weights_dtype": dtype} for dtype in ("int8", "float8", "int4", "int2")},
}
OPTION_KEYS = {"torchao": {"quant_type", "quant_type_kwargs", "modules_to_not_convert"},
               "quanto": {"weights_dtype", "modules_to_not_convert"}}  # bitsandbytes: BitsAndBytesConfig's own
LORA_BACKENDS = ("torchao", "quanto")  # tested: tests/test_quantization.py
LORA_REASON = ("dvllm's batched LoRA layers keep their adapter tables in the base layer's weight dtype, which "
               "this backend packs into integers; LoRA works on torchao- and quanto-quantized layers, whose "
               "weights keep the model's float dtype")
FP8_DYNAMIC = ("Float8DynamicActivationFloat8WeightConfig",)  # torchao: CUDA capability 8.9+ (Ada, Hopper)
TORCHAO_KERNELS = {"Int4WeightOnlyConfig": "mslk"}  # torchao's int4 packing calls Meta's MSLK CUDA kernels


@dataclass(frozen=True)
class QuantizationSpec:
    backend: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    components: tuple[str, ...] | None = None  # None: the denoiser (transformer or unet)
    text: str = field(default="", compare=False)  # as the user wrote it, for messages and logs

    def __str__(self) -> str:
        return self.text or self.backend


def parse_quantization(value: Any) -> QuantizationSpec | None:
    """The user's spec, checked as far as can be before a model is chosen; ValueError naming what is wrong."""
    if value is None or isinstance(value, QuantizationSpec):
        return value
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization: not valid JSON: {e}") from None
    if isinstance(value, str):
        backend, _, option = value.strip().partition(":")
        _check_backend(backend)
        choices = SHORT_OPTIONS[backend]
        if option and option not in choices:
            raise ValueError(f"quantization: {backend} takes one of {list(choices)} after the colon, got "
                             f"{option!r} (JSON form for other options)")
        spec = QuantizationSpec(backend, dict(choices[option or next(iter(choices))]), None, value.strip())
    elif isinstance(value, dict):
        spec = _from_dict(value)
    else:
        raise ValueError(f"quantization must be BACKEND[:OPTION] or a JSON object, got {value!r}")
    backend_config(spec)  # builds diffusers' own config once: its checks of the options run now
    return spec


def _from_dict(value: dict[str, Any]) -> QuantizationSpec:
    unknown = sorted(set(value) - {"backend", "options", "components"})
    if unknown:
        raise ValueError(f"quantization: unknown key(s) {unknown}; allowed: backend, options, components")
    backend, options, components = value.get("backend"), value.get("options", {}), value.get("components")
    _check_backend(backend)
    if not isinstance(options, dict):
        raise ValueError(f"quantization: options must be a JSON object, got {options!r}")
    if isinstance(components, str):
        components = [components]
    if components is not None and not (isinstance(components, list) and components
                                       and all(isinstance(c, str) and c for c in components)):
        raise ValueError(f"quantization: components must be a non-empty list of component names, got {components!r}")
    allowed = OPTION_KEYS.get(backend)
    if allowed is not None and set(options) - allowed:
        raise ValueError(f"quantization: unknown {backend} option(s) {sorted(set(options) - allowed)}; allowed: "
                         f"{sorted(allowed)}")
    if backend == "torchao" and "quant_type" not in options:
        raise ValueError(f"quantization: torchao needs options.quant_type: one of {list(TORCHAO_TYPES)} or a "
                         "torchao.quantization config class name")
    if backend == "bitsandbytes" and not (options.get("load_in_4bit") or options.get("load_in_8bit")):
        raise ValueError("quantization: bitsandbytes needs options.load_in_4bit or options.load_in_8bit set to true")
    return QuantizationSpec(backend, dict(options), tuple(components) if components else None,
                            json.dumps(value, sort_keys=True))


def _check_backend(backend: Any) -> None:
    if backend == "gguf":
        raise ValueError("quantization: gguf quantizes nothing while loading: it reads files already quantized "
                         "(a single-file .gguf checkpoint); choose torchao, bitsandbytes or quanto here")
    if backend not in PACKAGES:
        raise ValueError(f"quantization: unknown backend {backend!r}; known: {list(PACKAGES)} (and gguf, for "
                         "prequantized .gguf files)")
    package, module = PACKAGES[backend]
    if not _installed(module):
        raise ValueError(f"quantization backend {backend!r} needs the {package} package: pip install {package}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (optimum) is missing
        return False


def backend_config(spec: QuantizationSpec, library: str = "diffusers") -> Any:
    """The backend's quantization config for a component of `library` (diffusers or transformers)."""
    options = dict(spec.options)
    if spec.backend == "torchao":
        options["quant_type"] = _torchao_type(options.pop("quant_type"), options.pop("quant_type_kwargs", {}))
    if spec.backend == "quanto" and library == "transformers":  # transformers' QuantoConfig names it `weights`
        options["weights"] = options.pop("weights_dtype", "int8")
    if library == "diffusers":
        from diffusers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as mapping
    else:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as mapping
    cls = mapping["bitsandbytes_4bit" if spec.backend == "bitsandbytes" else spec.backend]
    if spec.backend == "bitsandbytes":  # its config only logs options it does not know
        import inspect

        unknown = sorted(set(options) - set(inspect.signature(cls.__init__).parameters) - {"self"})
        if unknown:
            raise ValueError(f"quantization: unknown bitsandbytes option(s) {unknown}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"quantization {spec}: {e}") from None


def _torchao_type(name: Any, kwargs: Any) -> Any:
    import torchao.quantization as ao
    from torchao.core.config import AOBaseConfig

    cls_name = TORCHAO_TYPES.get(name, name)
    cls = getattr(ao, cls_name, None) if isinstance(cls_name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, AOBaseConfig)):
        raise ValueError(f"quantization: torchao quant_type must be one of {list(TORCHAO_TYPES)} or a "
                         f"torchao.quantization config class name, got {name!r}")
    kernels = TORCHAO_KERNELS.get(cls_name)
    if kernels and not _installed(kernels):
        raise ValueError(f"quantization: torchao {cls_name} needs the {kernels} package (CUDA kernels, "
                         "https://github.com/meta-pytorch/MSLK); int8wo and float8wo need none")
    if not isinstance(kwargs, dict):
        raise ValueError(f"quantization: torchao quant_type_kwargs must be a JSON object, got {kwargs!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:  # torchao checks its configs with asserts
        raise ValueError(f"quantization: torchao {cls_name}({kwargs}): {e}") from None


def check_use(spec: QuantizationSpec | None, model: str | None, load_format: str, enable_lora: bool) -> None:
    """What the engine's other settings ask of a quantized model, refused before it loads."""
    if enable_lora and str(model or "").lower().endswith(".gguf"):
        raise ValueError(f"LoRA serving cannot run on the GGUF-quantized layers of {model}: {LORA_REASON}")
    if spec is None:
        return
    if enable_lora and spec.backend not in LORA_BACKENDS:
        raise ValueError(f"LoRA serving cannot run on {spec.backend}-quantized layers: {LORA_REASON}")
    from dvllm.models.model_names import preset_names

    if spec.backend != "torchao" and (load_format == "dummy" or model in preset_names()):
        raise ValueError(f"quantization {spec}: load_format='dummy' and the presets build random weights instead "
                         f"of loading them, and {spec.backend} quantizes only while loading (from_pretrained); "
                         "torchao quantizes built weights too")


def components_of(spec: QuantizationSpec, model_index: dict[str, Any]) -> dict[str, str]:
    """{component: its library} that the spec quantizes in this model (its denoiser unless it names others)."""
    models = {name: entry[0] for name, entry in model_index.items() if not name.startswith("_")
              and isinstance(entry, (list, tuple)) and entry[0] in ("diffusers", "transformers")
              and _is_model(*entry)}
    names = spec.components or tuple(n for n in ("transformer", "unet") if n in models)[:1]
    missing = [n for n in names if n not in models]
    if missing or not names:
        raise ValueError(f"quantization: this model has no model component {missing or 'transformer or unet'}; "
                         f"it has {sorted(models)}")
    return {name: models[name] for name in names}


def _is_model(library: str, class_name: str) -> bool:
    """A torch model (quantizable), not a scheduler or tokenizer of the same library."""
    cls = getattr(importlib.import_module(library), class_name, None)
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def pipeline_config(spec: QuantizationSpec, model_index: dict[str, Any]) -> Any:
    """diffusers' PipelineQuantizationConfig for from_pretrained: one config per component (a quant_mapping,
    since diffusers' and transformers' configs of one backend may take different options)."""
    from diffusers import PipelineQuantizationConfig

    check_device(spec)
    mapping = {name: backend_config(spec, library) for name, library in components_of(spec, model_index).items()}
    return PipelineQuantizationConfig(quant_mapping=mapping)


def check_device(spec: QuantizationSpec, device: torch.device | None = None) -> None:
    """bitsandbytes quantizes on a GPU only; torchao's FP8 dynamic activations need FP8 matmuls: a CUDA GPU of
    capability 8.9+ (quantizing on the CPU during from_pretrained checks this machine's GPU; `device`: where the
    model runs)."""
    if spec.backend == "bitsandbytes" and not (torch.cuda.is_available() and (device is None or device.type == "cuda")):
        raise ValueError(f"quantization {spec}: diffusers' bitsandbytes quantizer needs a CUDA GPU; on the CPU, "
                         "torchao:int8wo or quanto:int8")
    if spec.backend != "torchao" or TORCHAO_TYPES.get(spec.options["quant_type"], spec.options["quant_type"]) \
            not in FP8_DYNAMIC:
        return
    capable = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    if not capable or (device is not None and device.type != "cuda"):
        raise ValueError(f"quantization {spec}: FP8 dynamic activations need a CUDA GPU of compute capability 8.9+ "
                         f"(Ada, Hopper) to run on; torchao:float8wo (FP8 weights only) runs anywhere")


def finish_quantization(pipeline: Any, spec: QuantizationSpec, model_index: dict[str, Any]) -> None:
    """After loading: torchao quantizes, with its quantize_, the components from_pretrained did not (built with
    random weights, or passed in whole, as a single-file denoiser); then each must have quantized Linear layers
    (a backend may skip what it cannot do on this machine)."""
    for name in components_of(spec, model_index):
        module = getattr(pipeline, name)
        check_device(spec, module.device)
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        if not any(map(is_quantized, linears)):
            if spec.backend != "torchao":
                raise ValueError(f"quantization {spec}: {name} was not loaded by from_pretrained, where "
                                 f"{spec.backend} quantizes; torchao quantizes such components too")
            _torchao_quantize(module, spec)
        done = sum(map(is_quantized, linears))
        if not done:
            raise ValueError(f"quantization {spec} left no Linear layer of {name} quantized here (torchao's int4wo, "
                             "for one, needs CUDA kernels)")
        logger.info("quantization %s: %d of %d Linear layers of %s quantized", spec, done, len(linears), name)


def quantizes_denoiser(spec: QuantizationSpec | None) -> bool:
    """Whether the spec quantizes the denoiser (it names no components, or names it): the modules that run beside
    it (controlnets) are then quantized as it is."""
    return spec is not None and (spec.components is None or bool({"transformer", "unet"} & set(spec.components)))


def quantize_loaded(module: torch.nn.Module, spec: QuantizationSpec, name: str) -> None:
    """A module loaded beside the pipeline (a controlnet) quantized as its denoiser: from_pretrained was given
    backend_config(spec); torchao quantizes what it could not (and must leave some Linear layer quantized)."""
    check_device(spec, next(module.parameters()).device)
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    if not any(map(is_quantized, linears)) and spec.backend == "torchao":
        _torchao_quantize(module, spec)
    done = sum(map(is_quantized, linears))
    if linears and not done:
        raise ValueError(f"quantization {spec} left no Linear layer of {name} quantized here")
    logger.info("quantization %s: %d of %d Linear layers of %s quantized", spec, done, len(linears), name)


def _torchao_quantize(module: torch.nn.Module, spec: QuantizationSpec) -> None:
    from torchao.quantization import quantize_

    config = backend_config(spec)
    skip = config.modules_to_not_convert or []

    def wanted(m: torch.nn.Module, fqn: str) -> bool:  # Linear layers, as diffusers' torchao quantizer takes
        return isinstance(m, torch.nn.Linear) and not any(f".{s}." in f".{fqn}." for s in skip)

    quantize_(module, config.quant_type, filter_fn=wanted)


def is_quantized(layer: torch.nn.Linear) -> bool:
    """A Linear layer whose weight a backend replaced: a tensor subclass (torchao, quanto, GGUF, bitsandbytes),
    packed integers."""
    weight = layer.weight
    return type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.dtype.is_floating_point
