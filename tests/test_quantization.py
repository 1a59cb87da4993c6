"""--quantization (models/quantization.py): weights quantized as they load, through diffusers'
PipelineQuantizationConfig. What runs on the CPU is run here: torchao int8 and FP8 weight-only and quanto int8 on
the tiny Flux transformer and SD UNet, a Q8_0 GGUF transformer written with the gguf package, LoRA on torchao and
quanto layers (bitsandbytes quantizes on a GPU only; torchao's FP8 dynamic needs FP8 matmuls). The
quantized layers are checked by their weights' types; images against the unquantized engine's, within bounds
measured here (the measured figure is printed: pytest -s)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from lora_utils import make_lora

from dvllm import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, SamplingParams
from dvllm.engine.start_checks import check_at_start
from dvllm.models import quantization
from dvllm.models.load_config import LoadConfig
from dvllm.models.quantization import QuantizationSpec, parse_quantization
from dvllm.models.single_file import load_component_file

pytest.importorskip("torchao")
PROMPTS = ["a red circle", "a blue square"]
PARAMS = [SamplingParams(num_inference_steps=4, seed=s, height=32, width=32, output_type="np") for s in (3, 4)]
# max abs difference (images in [0, 1]) from the unquantized engine's, measured on these tiny random models (2
# prompts, 4 steps, 32x32): int8wo flux 0.0037, sd 0.0024; float8wo flux 0.024, sd 0.011; quanto int8 flux 0.0030,
# sd 0.0022; with a LoRA adapter, flux int8wo 0.0055, quanto int8 0.0069; Q8_0 GGUF flux 0.0025. Bounds: ~1.5x.
BOUNDS = {("flux", "torchao:int8wo"): 0.006, ("sd", "torchao:int8wo"): 0.004,
          ("flux", "torchao:float8wo"): 0.036, ("sd", "torchao:float8wo"): 0.016,
          ("flux", "quanto:int8"): 0.005, ("sd", "quanto:int8"): 0.0035,
          ("flux lora", "torchao:int8wo"): 0.009, ("flux lora", "quanto:int8"): 0.011, ("flux", "gguf:Q8_0"): 0.004,
          ("sd controlnet", "torchao:int8wo"): 0.004}
WEIGHT_TYPES = {"torchao:int8wo": "Int8Tensor", "torchao:float8wo": "Float8Tensor", "quanto:int8": "WeightQBytesTensor"}
PACKAGES = {"torchao": "torchao", "quanto": "optimum.quanto"}


def engine(model: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=model, device="cpu", dtype="float32", **kwargs)


def images(eng: DiffusionEngine, **extra) -> list[np.ndarray]:
    params = [dataclasses.replace(p, **extra) for p in PARAMS]
    outs = eng.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.images[0] for o in outs]


def max_diff(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def linear_weights(module: torch.nn.Module) -> set[str]:
    return {type(m.weight).__name__ for m in module.modules() if isinstance(m, torch.nn.Linear)}


def pipeline_of(eng: DiffusionEngine):
    return eng.executor.worker.runner.adapter.pipeline


@pytest.fixture(scope="module")
def paths(flux_path, sd_eps_path) -> dict[str, str]:
    return {"flux": flux_path, "sd": sd_eps_path}


@pytest.fixture(scope="module")
def unquantized(paths) -> dict[str, list[np.ndarray]]:
    return {name: images(engine(path)) for name, path in paths.items()}


# -- the spec --------------------------------------------------------------------------------------------------

def test_short_and_json_forms():
    assert parse_quantization("torchao:int8wo") == QuantizationSpec("torchao", {"quant_type": "int8wo"})
    assert parse_quantization("torchao").options == {"quant_type": "int8wo"}  # the first option is the default
    assert parse_quantization("torchao:float8wo").options == {"quant_type": "float8wo"}
    spec = parse_quantization('{"backend": "torchao", "options": {"quant_type": "Int8WeightOnlyConfig", '
                              '"quant_type_kwargs": {"set_inductor_config": false}}, "components": ["transformer", '
                              '"text_encoder"]}')
    assert spec.components == ("transformer", "text_encoder")
    assert spec.options["quant_type_kwargs"] == {"set_inductor_config": False}
    as_dict = {"backend": "torchao", "options": {"quant_type": "float8wo"}, "components": "unet"}
    assert parse_quantization(as_dict).components == ("unet",)
    config = EngineConfig(quantization="torchao:int8wo")
    assert LoadConfig.of(config).quantization == parse_quantization("torchao:int8wo")


def test_the_flag_takes_both_forms():
    import argparse

    from dvllm.config_flags import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for text in ("torchao:float8wo", '{"backend": "torchao", "options": {"quant_type": "int8dq"}}'):
        config = EngineConfig(**engine_kwargs(parser.parse_args(["--quantization", text])))
        spec = LoadConfig.of(config).quantization
        assert spec == parse_quantization(text) and str(spec)


@pytest.mark.parametrize("spec, message", [
    ("awq:int4", r"unknown backend 'awq'; known: \['torchao', 'bitsandbytes', 'quanto'\]"),
    ("gguf", "files already quantized"),
    ("torchao:int3", r"takes one of \['int8wo', 'int8dq', 'int4wo', 'float8wo', 'float8dq'\]"),
    ('{"backend": "torchao"', "not valid JSON"),
    ('{"backend": "torchao", "option": {}}', r"unknown key\(s\) \['option'\]"),
    ('{"backend": "torchao", "options": {}}', "torchao needs options.quant_type"),
    ('{"backend": "torchao", "options": {"quant_type": "Linear"}}', "config class name, got 'Linear'"),
    ('{"backend": "torchao", "options": {"quant_type": "int8wo", "quant_type_kwargs": {"bits": 3}}}',
     r"torchao Int8WeightOnlyConfig\(\{'bits': 3\}\)"),
    ('{"backend": "torchao", "options": {"quant_type": "int8wo", "quant_type_kwargs": {"group_size": 16}}}',
     "Use granularity=PerGroup"),  # torchao's own check, an assert there
    ('{"backend": "torchao", "options": {"quant_type": "int8wo", "bits": 3}}', r"unknown torchao option\(s\)"),
    ('{"backend": "torchao", "options": {"quant_type": "int8wo"}, "components": []}', "non-empty list"),
    (42, "BACKEND"),
])
def test_bad_specs_are_refused_naming_why(spec, message):
    with pytest.raises(ValueError, match=message):
        check_at_start(EngineConfig(quantization=spec))


@pytest.mark.parametrize("engine_class", [DiffusionEngine, AsyncDiffusionEngine])
def test_an_engine_refuses_a_bad_spec_before_it_loads_anything(engine_class, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model started loading before the quantization spec was checked")
    monkeypatch.setattr("dvllm.engine.engine.create_executor", refuse)
    monkeypatch.setattr("dvllm.engine.async_engine.DiffusionEngine", refuse)
    with pytest.raises(ValueError, match="unknown backend 'awq'"):
        engine_class("tiny-sd", quantization="awq:int4")


def test_a_missing_backend_package_is_named(monkeypatch):
    monkeypatch.setattr(quantization, "_installed", lambda module: module == "torchao")
    with pytest.raises(ValueError, match="needs the bitsandbytes package: pip install bitsandbytes"):
        parse_quantization("bitsandbytes:nf4")
    with pytest.raises(ValueError, match="needs the optimum-quanto package: pip install optimum-quanto"):
        parse_quantization("quanto:int8")
    with pytest.raises(ValueError, match="Int4WeightOnlyConfig needs the mslk package"):
        parse_quantization("torchao:int4wo")


def test_other_backends_options_are_checked_by_diffusers_configs(monkeypatch):
    monkeypatch.setattr(quantization, "_installed", lambda module: True)  # their configs need no package
    assert parse_quantization("quanto:float8").options == {"weights_dtype": "float8"}
    with pytest.raises(ValueError, match="load_in_4bit or options.load_in_8bit"):
        parse_quantization('{"backend": "bitsandbytes", "options": {"bnb_4bit_quant_type": "nf4"}}')
    with pytest.raises(ValueError, match=r"unknown bitsandbytes option\(s\) \['load_in_3bit'\]"):
        parse_quantization('{"backend": "bitsandbytes", "options": {"load_in_4bit": true, "load_in_3bit": true}}')
    with pytest.raises(ValueError, match="both True"):
        parse_quantization('{"backend": "bitsandbytes", "options": {"load_in_4bit": true, "load_in_8bit": true}}')
    with pytest.raises(ValueError, match="Only support weights in"):
        parse_quantization('{"backend": "quanto", "options": {"weights_dtype": "int3"}}')
    # these quantize inside from_pretrained only: random-weight loads are refused before loading
    with pytest.raises(ValueError, match="quanto quantizes only while loading"):
        check_at_start(EngineConfig(model="sd15", quantization="quanto:int8"))


def test_fp8_dynamic_needs_a_hopper_class_gpu(flux_path):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine runs FP8 matmuls")
    with pytest.raises(ValueError, match="FP8 dynamic activations need a CUDA GPU of compute capability 8.9"):
        engine(flux_path, quantization="torchao:float8dq")


# -- on the CPU ----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd"])
@pytest.mark.parametrize("spec", ["torchao:int8wo", "torchao:float8wo", "quanto:int8"])
def test_the_denoiser_is_quantized_and_images_stay_close(paths, unquantized, model, spec):
    pytest.importorskip(PACKAGES[spec.split(":")[0]])
    eng = engine(paths[model], quantization=spec)
    pipe = pipeline_of(eng)
    denoiser = pipe.transformer if model == "flux" else pipe.unet
    assert linear_weights(denoiser) == {WEIGHT_TYPES[spec]}  # every Linear layer of the denoiser, nothing else
    assert linear_weights(pipe.text_encoder) == {"Parameter"}
    diff = max_diff(images(eng), unquantized[model])
    print(f"\n{model} {spec}: max abs difference from the unquantized images {diff:.4f}")
    assert 0 < diff < BOUNDS[model, spec]


def test_json_components_quantize_a_text_encoder_too(flux_path):
    spec = '{"backend": "torchao", "options": {"quant_type": "int8wo"}, "components": ["transformer", "text_encoder_2"]}'
    pipe = pipeline_of(engine(flux_path, quantization=spec))
    assert linear_weights(pipe.transformer) == linear_weights(pipe.text_encoder_2) == {"Int8Tensor"}  # T5: transformers'
    assert linear_weights(pipe.text_encoder) == {"Parameter"}
    with pytest.raises(ValueError, match=r"no model component \['unet'\]; it has \['text_encoder', 'text_encoder_2', "
                                         r"'transformer', 'vae'\]"):
        engine(flux_path, quantization='{"backend": "torchao", "options": {"quant_type": "int8wo"}, "components": '
                                       '["unet"]}')


@pytest.mark.parametrize("load_format", ["auto", "dummy"])  # dummy: torchao's quantize_ after the build
def test_modules_to_not_convert_stay_in_float(flux_path, load_format):
    spec = '{"backend": "torchao", "options": {"quant_type": "int8wo", "modules_to_not_convert": ["proj_out"]}}'
    transformer = pipeline_of(engine(flux_path, load_format=load_format, quantization=spec)).transformer
    assert type(transformer.proj_out.weight).__name__ == "Parameter"
    assert linear_weights(transformer) == {"Int8Tensor", "Parameter"}


# -- LoRA on quantized layers ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, flux_path) -> tuple[dict[str, str], list[np.ndarray]]:
    """(an adapter for the tiny Flux transformer, the unquantized engine's images with it)."""
    from conftest import tiny_flux_pipeline

    adapters = {"shift": make_lora(tiny_flux_pipeline(), str(tmp_path_factory.mktemp("lora") / "shift"), seed=11)}
    return adapters, images(engine(flux_path, lora_modules=adapters), loras={"shift": 1.0})


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["torchao:int8wo", "quanto:int8"])
def test_lora_runs_on_quantized_layers(lora_reference, flux_path, spec):
    pytest.importorskip(PACKAGES[spec.split(":")[0]])
    adapters, want = lora_reference
    quantized = engine(flux_path, lora_modules=adapters, quantization=spec)
    got = images(quantized, loras={"shift": 1.0})
    assert linear_weights(pipeline_of(quantized).transformer) == {WEIGHT_TYPES[spec]}
    layers = quantized.executor.worker.runner.lora
    assert any(table.filled for table in layers.tables.values())  # the adapter sits on the quantized layers
    diff = max_diff(got, want)
    print(f"\nflux {spec} with a LoRA adapter: max abs difference from the unquantized model's {diff:.4f}")
    assert diff < BOUNDS["flux lora", spec]
    assert max_diff(got, images(quantized)) > 20 * diff  # the adapter changed the image


def test_bitsandbytes_needs_a_gpu():
    spec = QuantizationSpec("bitsandbytes", {"load_in_8bit": True}, text="bitsandbytes:8bit")
    with pytest.raises(ValueError, match="bitsandbytes quantizer needs a CUDA GPU"):
        quantization.check_device(spec, torch.device("cpu"))


def test_lora_on_packed_weights_is_refused_at_start(tmp_path):
    spec = QuantizationSpec("bitsandbytes", {"load_in_4bit": True}, text="bitsandbytes:4bit")
    with pytest.raises(ValueError, match="LoRA serving cannot run on bitsandbytes-quantized layers: .*weight dtype"):
        quantization.check_use(spec, None, "auto", enable_lora=True)
    with pytest.raises(ValueError, match="LoRA serving cannot run on the GGUF-quantized layers"):
        check_at_start(EngineConfig(model=str(tmp_path / "flux-Q8_0.gguf"), enable_lora=True))


# -- GGUF: a prequantized file ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_gguf(tmp_path_factory, flux_path) -> str:
    pytest.importorskip("gguf")
    from diffusers import FluxTransformer2DModel
    from gguf_utils import write_gguf

    path = str(tmp_path_factory.mktemp("gguf") / "flux-Q8_0.gguf")
    transformer = FluxTransformer2DModel.from_pretrained(flux_path, subfolder="transformer")
    assert write_gguf(transformer, path) > 20  # most Linear weights: rows of a multiple of 32
    return path


def test_gguf_transformer_loads_quantized(flux_gguf, flux_path):
    from diffusers import FluxTransformer2DModel
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    model = load_component_file(flux_gguf, "FluxTransformer2DModel", flux_path, "transformer", torch.float32)
    to_q = model.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, GGUFLinear) and isinstance(to_q.weight, GGUFParameter) and to_q.weight.dtype == torch.uint8
    reference = FluxTransformer2DModel.from_pretrained(flux_path, subfolder="transformer")
    torch.manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 4, 32),
                  pooled_projections=torch.randn(1, 24), timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
                  txt_ids=torch.zeros(4, 3), guidance=torch.tensor([3.5]))
    with torch.no_grad():
        assert 0 < (model(**inputs).sample - reference(**inputs).sample).abs().max() < 0.02


@pytest.mark.slow
def test_a_gguf_model_serves_within_its_bound(flux_gguf, flux_path, unquantized):
    eng = engine(flux_gguf, base_model=flux_path)
    assert "GGUFParameter" in linear_weights(pipeline_of(eng).transformer)
    diff = max_diff(images(eng), unquantized["flux"])
    print(f"\nflux Q8_0 GGUF: max abs difference from the unquantized images {diff:.4f}")
    assert 0 < diff < BOUNDS["flux", "gguf:Q8_0"]


@pytest.fixture(scope="module")
def edges(sd_eps_path, tmp_path_factory) -> dict[str, str]:
    from diffusers import UNet2DConditionModel
    from test_controlnet import tiny_controlnet

    folder = tmp_path_factory.mktemp("controlnet-edges")
    tiny_controlnet(UNet2DConditionModel.from_pretrained(sd_eps_path, subfolder="unet"), 10).save_pretrained(folder)
    return {"edges": str(folder)}


@pytest.mark.slow
def test_controlnets_are_quantized_as_the_denoiser(sd_eps_path, edges, unquantized):
    """A controlnet runs beside the UNet: quantized as it is (and not when the spec names other components)."""
    from test_controlnet import control, control_image

    controls = [control("edges", control_image(1), scale=0.8)]
    eng = engine(sd_eps_path, quantization="torchao:int8wo", controlnets=edges)
    assert linear_weights(eng.executor.worker.controlnets["edges"]) == {"Int8Tensor"}
    exact = engine(sd_eps_path, controlnets=edges)
    diff = max_diff(images(eng, controls=controls), images(exact, controls=controls))
    print(f"\nsd controlnet torchao:int8wo: max abs difference from the unquantized images {diff:.4f}")
    assert 0 < diff < BOUNDS["sd controlnet", "torchao:int8wo"]
    assert max_diff(images(exact, controls=controls), unquantized["sd"]) > 0.01  # the control acts
    text_only = '{"backend": "torchao", "options": {"quant_type": "int8wo"}, "components": ["text_encoder"]}'
    other = engine(sd_eps_path, quantization=text_only, controlnets=edges)
    assert linear_weights(other.executor.worker.controlnets["edges"]) == {"Parameter"}
