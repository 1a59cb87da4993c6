"""IP-Adapter image prompts per request inside one forward, against diffusers' pipelines request by request.

One batch mixes rows without an image prompt, with one image at two scales, with another image (with and without
CFG, n=2): each request's images equal the diffusers pipeline's with the same seed, after load_ip_adapter and
set_ip_adapter_scale(its scale) (the plain pipeline's without an image prompt), and so do its latents. The tiny
IP-Adapter is random weights in diffusers' format ({"image_proj": ..., "ip_adapter": ...} as a .safetensors
file, beside a tiny CLIPVisionModelWithProjection saved with save_pretrained), loaded through the real loader.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from request_checks import assert_each_request_matches
from dvllm import DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams
EMBED_DIM = 12  # the tiny image encoder's projection
FAMILIES = {"sd": ("sd_eps_path", StableDiffusionPipeline), "sdxl": ("sdxl_path", StableDiffusionXLPipeline)}


def tiny_image_encoder(folder) -> None:
    torch.manual_seed(5)
    CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, projection_dim=EMBED_DIM, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=24, patch_size=8)).save_pretrained(folder)


def _hidden_size(unet, name: str) -> int:
    channels = unet.config.block_out_channels
    if name.startswith("mid_block"):
        return channels[-1]
    if name.startswith("up_blocks"):
        return list(reversed(channels))[int(name[len("up_blocks.")])]
    return channels[int(name[len("down_blocks.")])]


def tiny_unet_ip_adapter(unet, path, seed: int = 7, plus: bool = False) -> None:
    """An IP-Adapter for `unet` as the file diffusers' load_ip_adapter reads: the projection (of the original kind,
    an ImageProjection to 4 tokens; `plus`: a resampler of the image encoder's hidden states, in the original
    checkpoints' names), and to_k_ip / to_v_ip for each cross-attention, numbered 1, 3, 5..."""
    dim, g = unet.config.cross_attention_dim, torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    weights = {"image_proj.proj.weight": randn(4 * dim, EMBED_DIM), "image_proj.proj.bias": randn(4 * dim, scale=0.1),
               "image_proj.norm.weight": 1 + randn(dim, scale=0.1), "image_proj.norm.bias": randn(dim, scale=0.1)}
    if plus:
        weights = {f"image_proj.{k}": v for k, v in _plus_projection(dim, seed).items()}
    cross = [name for name in unet.attn_processors if not name.endswith("attn1.processor")]
    for key, name in zip(range(1, 2 * len(cross), 2), cross):
        for part in ("to_k_ip", "to_v_ip"):
            weights[f"ip_adapter.{key}.{part}.weight"] = randn(_hidden_size(unet, name), dim)
    save_file(weights, str(path))


def _plus_projection(dim: int, seed: int) -> dict[str, torch.Tensor]:
    """IPAdapterPlusImageProjection's weights (4 queries, one 64-wide head, depth 4: what the loader reads of
    a checkpoint) under the names of the original checkpoints, which diffusers' loader converts back."""
    from diffusers.models.embeddings import IPAdapterPlusImageProjection

    torch.manual_seed(seed)
    module = IPAdapterPlusImageProjection(embed_dims=16, output_dims=dim, hidden_dims=64, depth=4, dim_head=64,
                                          heads=1, num_queries=4)
    state, out = module.state_dict(), {}
    for name, value in state.items():
        i = name.split(".")[1] if name.startswith("layers.") else None
        original = (name.replace(f"layers.{i}.ln0", f"layers.{i}.0.norm1").replace(f"layers.{i}.ln1", f"layers.{i}.0.norm2")
                    .replace(f"layers.{i}.attn.to_out.0", f"layers.{i}.0.to_out")
                    .replace(f"layers.{i}.attn.to_q", f"layers.{i}.0.to_q")
                    .replace(f"layers.{i}.ff.0", f"layers.{i}.1.0").replace(f"layers.{i}.ff.1.net.0.proj", f"layers.{i}.1.1")
                    .replace(f"layers.{i}.ff.1.net.2", f"layers.{i}.1.3")) if i is not None else name
        if ".attn.to_k." in name:
            out[f"layers.{i}.0.to_kv.weight"] = torch.cat([value, state[name.replace("to_k", "to_v")]])
        elif ".attn.to_v." not in name:
            out[original] = value
    return out


def tiny_flux_ip_adapter(transformer, path, seed: int = 8) -> None:
    """Flux's kind (XLabs' layout as diffusers reads it): an ImageProjection to 4 tokens of the text's width, and
    to_k_ip / to_v_ip with biases for each double-stream block, numbered 0, 1, ..."""
    config, g = transformer.config, torch.Generator().manual_seed(seed)
    dim, inner = config.joint_attention_dim, config.num_attention_heads * config.attention_head_dim

    def randn(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    weights = {"image_proj.proj.weight": randn(4 * dim, EMBED_DIM), "image_proj.proj.bias": randn(4 * dim, scale=0.1),
               "image_proj.norm.weight": 1 + randn(dim, scale=0.1), "image_proj.norm.bias": randn(dim, scale=0.1)}
    for key in range(len(transformer.transformer_blocks)):
        for part in ("to_k_ip", "to_v_ip"):
            weights[f"ip_adapter.{key}.{part}.weight"] = randn(inner, dim)
            weights[f"ip_adapter.{key}.{part}.bias"] = randn(inner, scale=0.1)
    save_file(weights, str(path))


def image_prompt(seed: int, size: tuple[int, int] = (20, 24)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    fixture, pipeline_class = FAMILIES[request.param]
    path = request.getfixturevalue(fixture)
    folder = tmp_path_factory.mktemp(f"{request.param}-ip-adapter")
    tiny_image_encoder(folder / "image_encoder")
    plain = pipeline_class.from_pretrained(path)
    tiny_unet_ip_adapter(plain.unet, folder / "ip-adapter.safetensors")
    with_adapter = pipeline_class.from_pretrained(path)
    with_adapter.load_ip_adapter(str(folder), subfolder="", weight_name="ip-adapter.safetensors")
    for pipe in (plain, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32",
                             ip_adapter=str(folder / "ip-adapter.safetensors"))
    yield engine, plain, with_adapter
    engine.shutdown()


def reference(family, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, plain, with_adapter = family
    common = dict(negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps, height=p.height,
                  width=p.width, num_images_per_prompt=p.n, guidance_scale=p.guidance_scale,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
    if p.ip_adapter_image is None:
        return plain(prompt, **common).images
    with_adapter.set_ip_adapter_scale(p.ip_adapter_scale)
    return with_adapter(prompt, ip_adapter_image=p.ip_adapter_image, **common).images


def mixed() -> list[tuple[str, SamplingParams]]:
    one, two = image_prompt(1), image_prompt(2, (16, 30))
    size = dict(height=16, width=16)
    return [
        ("a red circle", P(num_inference_steps=4, guidance_scale=5.0, seed=1, **size)),
        ("a blue square", P(num_inference_steps=5, guidance_scale=5.0, seed=2, ip_adapter_image=one, **size)),
        ("a blue square", P(num_inference_steps=3, guidance_scale=1.0, seed=3, ip_adapter_image=one,
                            ip_adapter_scale=0.4, **size)),
        ("two triangles", P(num_inference_steps=4, guidance_scale=3.0, seed=5, n=2, negative_prompt="blurry",
                            ip_adapter_image=two, ip_adapter_scale=0.8, **size)),
    ]


def test_a_mixed_batch_equals_the_pipelines_with_the_adapter(family):
    engine = family[0]
    batch = mixed()
    assert_each_request_matches(engine, batch, lambda prompt, p, output_type: reference(family, prompt, p, output_type))


def test_the_image_prompt_and_its_scale_change_the_image(family):
    """The comparison above could pass with image prompts ignored if the tiny adapter did nothing: it does not;
    and scale 0 is the image without the adapter, as diffusers skips an adapter of scale 0."""
    engine = family[0]
    base = dict(num_inference_steps=3, guidance_scale=5.0, seed=9, height=16, width=16, output_type="np")
    plain, full, half, zero = engine.generate(["a cat"] * 4, [
        P(**base), P(**base, ip_adapter_image=image_prompt(3)),
        P(**base, ip_adapter_image=image_prompt(3), ip_adapter_scale=0.5),
        P(**base, ip_adapter_image=image_prompt(3), ip_adapter_scale=0.0)], use_tqdm=False)
    assert np.abs(plain.images[0] - full.images[0]).max() > 0.05
    assert np.abs(full.images[0] - half.images[0]).max() > 0.01
    np.testing.assert_array_equal(plain.images[0], zero.images[0])


def test_an_image_to_image_request_takes_an_image_prompt_as_the_img2img_pipeline(family):
    """Beside a text-to-image row with an image prompt: StableDiffusion[XL]Img2ImgPipeline built from the adapter's
    pipeline (its UNet, image encoder and feature extractor) with the same scale."""
    from diffusers import AutoPipelineForImage2Image

    engine, _, with_adapter = family
    start = image_prompt(7, (16, 16))
    batch = [("a cat", P(num_inference_steps=4, guidance_scale=4.0, seed=1, image=start, strength=0.7,
                         ip_adapter_image=image_prompt(8), ip_adapter_scale=0.6, output_type="latent")),
             ("a dog", P(num_inference_steps=3, guidance_scale=4.0, seed=2, height=16, width=16,
                         ip_adapter_image=image_prompt(8), output_type="latent"))]
    outs = engine.generate([q for q, _ in batch], [p for _, p in batch], use_tqdm=False)
    img2img = AutoPipelineForImage2Image.from_pipe(with_adapter)
    img2img.set_ip_adapter_scale(0.6)
    want = img2img("a cat", image=start, strength=0.7, num_inference_steps=4, guidance_scale=4.0,
                   ip_adapter_image=image_prompt(8), generator=torch.Generator("cpu").manual_seed(1),
                   output_type="latent").images
    assert outs[0].error is None, outs[0].error
    assert float(np.abs(np.stack(outs[0].images) - np.asarray(want)).max()) <= LATENT_TOL
    want = np.asarray(reference(family, *batch[1], "latent"))
    assert float(np.abs(np.stack(outs[1].images) - want).max()) <= LATENT_TOL


def test_a_plus_adapter_reads_hidden_states_and_equals_the_pipeline(sd_eps_path, tmp_path):
    """A plus adapter (a resampler of the encoder's penultimate hidden states; an all-zero image's for the
    unconditional rows) beside a row without an image prompt equals the pipeline, with and without CFG."""
    tiny_image_encoder(tmp_path / "image_encoder")
    plain = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    tiny_unet_ip_adapter(plain.unet, tmp_path / "plus.safetensors", seed=9, plus=True)
    with_adapter = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    with_adapter.load_ip_adapter(str(tmp_path), subfolder="", weight_name="plus.safetensors")
    for pipe in (plain, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32",
                             ip_adapter=str(tmp_path / "plus.safetensors"))
    size = dict(height=16, width=16, output_type="latent")
    batch = [("a cat", P(num_inference_steps=3, guidance_scale=4.0, seed=1, ip_adapter_image=image_prompt(5),
                         ip_adapter_scale=0.7, **size)),
             ("a dog", P(num_inference_steps=3, guidance_scale=1.0, seed=2, ip_adapter_image=image_prompt(6), **size)),
             ("a dog", P(num_inference_steps=2, guidance_scale=4.0, seed=3, **size))]
    try:
        outs = engine.generate([q for q, _ in batch], [p for _, p in batch], use_tqdm=False)
    finally:
        engine.shutdown()
    family = (None, plain, with_adapter)
    for (prompt, p), out in zip(batch, outs):
        assert out.error is None, out.error
        want = np.asarray(reference(family, prompt, p, "latent"))
        assert float(np.abs(np.stack(out.images) - want).max()) <= LATENT_TOL
    assert np.abs(np.asarray(reference(family, "a cat", P(**{**vars(batch[0][1]), "ip_adapter_image": None}),
                                       "latent")) - np.stack(outs[0].images)).max() > 1e-2


def test_a_call_on_some_rows_gets_their_image_prompts_only():
    """A call on some of the forward's rows (step caching's and per-shape calls narrow them) adds to its own
    positions of the plan's rows, with their tokens and scales; a call on none of them runs plain."""
    from dvllm.worker.forward_context import ForwardContext, ForwardHooks
    from dvllm.worker.image_prompts import ImagePromptPlan, ImagePromptRows

    rows = ImagePromptRows(lambda embeds: [e * 10 for e in embeds], ForwardHooks())
    embeds = torch.arange(3.0).view(3, 1, 1, 1)  # rows 1, 3, 4: [rows, 1 image, 1 token, 1]
    context = ForwardContext(image_prompt=ImagePromptPlan([1, 3, 4], torch.tensor([1, 3, 4]), embeds, [0.5, 1.0, 2.0]))
    rows.context = context
    whole = rows.current()
    assert whole.index.tolist() == [1, 3, 4] and whole.tokens[0].flatten().tolist() == [0.0, 10.0, 20.0]
    with context.narrow([0, 3, 4], torch.tensor([0, 3, 4])):
        part = rows.current()
        assert part.index.tolist() == [1, 2] and part.tokens[0].flatten().tolist() == [10.0, 20.0]
        assert part.scales.flatten().tolist() == [1.0, 2.0]
        total = rows.add(torch.zeros(3, 1, 1), part, torch.ones(2, 1, 1))
        assert total.flatten().tolist() == [0.0, 1.0, 2.0]
    with context.narrow([0, 2], torch.tensor([0, 2])):
        assert rows.current() is None
    rows.context = None
    assert rows.current() is None


def test_lora_rows_and_image_prompt_rows_share_a_forward(sd_eps_path, tmp_path):
    """A request with a LoRA adapter and an image prompt, one with the adapter only and one with the image only:
    each equals the pipeline with load_lora_weights / set_adapters and load_ip_adapter / set_ip_adapter_scale."""
    from lora_utils import make_lora, reference_images

    plain = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    adapters = {"style": make_lora(plain, str(tmp_path / "style"), seed=11)}
    tiny_image_encoder(tmp_path / "image_encoder")
    tiny_unet_ip_adapter(plain.unet, tmp_path / "ip.safetensors")
    with_adapter = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    with_adapter.load_ip_adapter(str(tmp_path), subfolder="", weight_name="ip.safetensors")
    for pipe in (plain, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", lora_modules=adapters,
                             ip_adapter=str(tmp_path / "ip.safetensors"))
    size = dict(height=16, width=16, num_inference_steps=3, guidance_scale=4.0, output_type="latent")
    batch = [P(seed=1, loras={"style": 0.8}, ip_adapter_image=image_prompt(1), ip_adapter_scale=0.6, **size),
             P(seed=2, loras={"style": 1.0}, **size), P(seed=3, ip_adapter_image=image_prompt(2), **size)]
    try:
        outs = engine.generate(["a cat"] * 3, batch, use_tqdm=False)
    finally:
        engine.shutdown()
    for p, out in zip(batch, outs):
        assert out.error is None, out.error
        call = dict(prompt="a cat", height=16, width=16, num_inference_steps=3, guidance_scale=4.0,
                    output_type="latent", generator=torch.Generator("cpu").manual_seed(p.seed))
        if p.ip_adapter_image is None:
            want = reference_images(plain, adapters, p.loras, **call)
        else:
            with_adapter.set_ip_adapter_scale(p.ip_adapter_scale)
            want = reference_images(with_adapter, adapters, p.loras, ip_adapter_image=p.ip_adapter_image, **call)
        assert float(np.abs(np.stack(out.images) - np.asarray(want)).max()) <= LATENT_TOL


@pytest.mark.parametrize("params, message", [
    (dict(ip_adapter_scale=-1), r"ip_adapter_scale must be a number in \[0, 10\]"),
    (dict(ip_adapter_scale=float("nan")), r"ip_adapter_scale must be a number"),
    (dict(ip_adapter_scale="1"), r"ip_adapter_scale must be a number"),
    (dict(ip_adapter_image=3), r"ip_adapter_image: expected a PIL image"),
    (dict(ip_adapter_image="/no/such/image.png"), r"ip_adapter_image: cannot read it as an image"),
    (dict(ip_adapter_image=image_prompt(1, (400, 400))), r"ip_adapter_image: 400x400 is over max_image_pixels"),
])
def test_bad_image_prompts_are_refused_naming_the_field(family, params, message):
    with pytest.raises(ValueError, match=message):
        family[0].add_request("bad", "a cat", P(**params))


def test_an_engine_without_an_adapter_refuses_image_prompts(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    try:
        with pytest.raises(ValueError, match="ip_adapter_image: this engine serves no IP-Adapter"):
            engine.add_request("r", "a cat", P(ip_adapter_image=image_prompt(1)))
    finally:
        engine.shutdown()


def test_what_cannot_serve_an_adapter_is_refused_at_start(sd_eps_path, qwen_image_path, family, tmp_path):
    weights = family[0].config.ip_adapter
    with pytest.raises(ValueError, match="does not serve .*ip_adapter"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", ip_adapter=weights, cfg_parallel_size=2)
    with pytest.raises(ValueError, match="ip_adapter: the qwen-image family takes no IP-Adapter"):
        DiffusionEngine(model=qwen_image_path, device="cpu", dtype="float32", ip_adapter=weights)
    with pytest.raises(ValueError, match="ip_adapter: expected a weights file"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", ip_adapter=str(tmp_path))
    with pytest.raises(ValueError, match="ip_adapter_image_encoder is set but no ip_adapter"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", ip_adapter_image_encoder=str(tmp_path))


@pytest.fixture(scope="module")
def flux(flux_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux-ip-adapter")
    tiny_image_encoder(folder / "image_encoder")
    plain = FluxPipeline.from_pretrained(flux_path)
    tiny_flux_ip_adapter(plain.transformer, folder / "ip-adapter.safetensors")
    with_adapter = FluxPipeline.from_pretrained(flux_path)
    with_adapter.load_ip_adapter(str(folder), weight_name="ip-adapter.safetensors",
                                 image_encoder_pretrained_model_name_or_path=str(folder / "image_encoder"),
                                 image_encoder_dtype=torch.float32)
    for pipe in (plain, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32",
                             ip_adapter=str(folder / "ip-adapter.safetensors"))
    yield engine, plain, with_adapter
    engine.shutdown()


def flux_reference(flux, prompt: str, p: SamplingParams, output_type: str) -> np.ndarray:
    _, plain, with_adapter = flux
    common = dict(num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                  num_images_per_prompt=p.n, guidance_scale=p.guidance_scale, output_type=output_type,
                  generator=torch.Generator("cpu").manual_seed(p.seed))
    if p.ip_adapter_image is None:
        return plain(prompt, **common).images
    with_adapter.set_ip_adapter_scale(float(p.ip_adapter_scale))
    return with_adapter(prompt, ip_adapter_image=p.ip_adapter_image, **common).images


def test_a_mixed_flux_batch_equals_the_flux_pipelines_with_the_adapter(flux):
    one, two = image_prompt(1), image_prompt(2, (16, 30))
    size = dict(height=16, width=16)
    batch = [("a red circle", P(num_inference_steps=3, guidance_scale=3.5, seed=1, **size)),
             ("a blue square", P(num_inference_steps=4, guidance_scale=3.5, seed=2, ip_adapter_image=one, **size)),
             ("a blue square", P(num_inference_steps=3, guidance_scale=2.0, seed=3, ip_adapter_image=one,
                                 ip_adapter_scale=0.4, **size)),
             ("two triangles", P(num_inference_steps=3, guidance_scale=3.5, seed=5, n=2, ip_adapter_image=two,
                                 ip_adapter_scale=0.8, **size))]
    for output_type, tol in (("np", TOL), ("latent", LATENT_TOL)):
        params = [P(**{**vars(p), "output_type": output_type}) for _, p in batch]
        outs = flux[0].generate([q for q, _ in batch], params, use_tqdm=False)
        for (prompt, p), out in zip(batch, outs):
            assert out.error is None, out.error
            want = np.asarray(flux_reference(flux, prompt, p, output_type))
            got = np.stack([np.asarray(image) for image in out.images])
            assert got.shape == want.shape
            diff = float(np.abs(got - want).max())
            assert diff <= tol, f"flux {prompt!r} scale {p.ip_adapter_scale} {output_type}: max abs diff {diff}"
    changed = flux[0].generate(["a red circle"] * 2, [P(num_inference_steps=3, seed=1, **size, output_type="np"),
                                                      P(num_inference_steps=3, seed=1, **size, output_type="np",
                                                        ip_adapter_image=one)], use_tqdm=False)
    assert np.abs(changed[0].images[0] - changed[1].images[0]).max() > 0.05  # (else the above could pass without)
    with pytest.raises(ValueError, match="ip_adapter_image: not served with step caching"):
        flux[0].add_request("r", "a cat", P(ip_adapter_image=one, cache={"method": "first_block"}))
