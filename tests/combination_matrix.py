"""The combination matrix's parts: the families' tiny pipelines, the engine's modes as factors, what each mode
asks of the engine and of a batch, and how a cell runs (tests/test_combination_matrix.py runs them).

A cell is one engine: a family and one value of each mode. Its batch mixes what the modes put in requests (LoRA
rows beside plain ones, controlled rows beside uncontrolled ones, each step-cache method beside uncached rows, a low-priority request preempted by later
ones, a request asked again for the result cache), and each request's images must equal the plain engine's for
the same request (an in-process DiffusionEngine with no mode on but those that change images by design: the
adapters, the controlnets, the cache, the quantization, the tiled VAE), to 1e-5 on [0, 1] images in float32 on the CPU.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image

from dvllm import AsyncDiffusionEngine, DiffusionEngine, SamplingParams

TOL = 1e-5
STEPS = 4
DEADLINE_S = 600.0  # one cell's whole run, on a loaded machine: a hang fails the cell instead of CI


@dataclass(frozen=True)
class Family:
    """One served family's tiny pipeline and what its requests carry."""

    build: Callable[[], Any]
    image: bool = False  # requests edit an input image
    mask: bool = False   # ... inside a mask (inpainting)
    video: bool = False
    text_row: bool = False  # r1 brings no image (the model takes one optionally: Wan 2.2 TI2V)
    size: int | None = None  # its requests' height and width (None: 16 for a video, 32 for an image)
    cfg: bool = True  # guidance runs as CFG rows (Flux and Kontext embed it: one row an image)
    # The preempted request's steps: it must still run when the requests that preempt it are ready, which with an
    # encode stage or encode processes is once their texts (and an edit's image) are encoded: about a second here
    # (Qwen-Image-Edit's victim steps take about 0.2 s each: fewer of them run as long). 48 were too few once: a tiny
    # video's steps take milliseconds, and in one CI run wan-i2v's victim (encode processes, core process) finished
    # before the requests sent after its first step were ready, so nothing preempted it.
    victim_steps: int = 96
    # vae_tile_size smaller than the images, so the tiled decode tiles (AutoencoderKL's; twice the VAE's scale
    # at least). None: the VAE tiles its own way (Wan's, Qwen-Image's), at sizes past these tiny images.
    tile: int | None = 16

    @property
    def side(self) -> int:
        return self.size or (16 if self.video else 32)


def _inpainting():
    import torch
    from diffusers import StableDiffusionInpaintPipeline, UNet2DConditionModel

    from conftest import tiny_sd_pipeline

    base = tiny_sd_pipeline()
    torch.manual_seed(7)
    unet = UNet2DConditionModel.from_config({**base.unet.config, "in_channels": 9})  # latents, mask, masked image
    return StableDiffusionInpaintPipeline(**{**base.components, "unet": unet})


def _families() -> dict[str, Family]:
    import conftest
    from qwen_edit_utils import tiny_qwen_image_edit_pipeline
    from test_flux_kontext import tiny_flux_kontext_pipeline

    return {
        "sd": Family(conftest.tiny_sd_pipeline),
        "sdxl": Family(conftest.tiny_sdxl_pipeline),
        "sd3": Family(conftest.tiny_sd3_pipeline),
        "flux": Family(conftest.tiny_flux_pipeline, cfg=False),
        # Kontext resizes its input image to about 1024x1024: tiles of 256 px encode it (tiles the size of the
        # tiny 16x VAE's minimum leave an edge tile of one latent pixel, which its GroupNorm refuses)
        "kontext": Family(tiny_flux_kontext_pipeline, image=True, tile=256, cfg=False),
        "qwen-image": Family(conftest.tiny_qwen_image_pipeline, tile=None),
        "qwen-image-edit": Family(lambda: tiny_qwen_image_edit_pipeline(plus=True), image=True, tile=None,
                                  victim_steps=32),
        "z-image": Family(conftest.tiny_z_image_pipeline),
        "wan": Family(conftest.tiny_wan_pipeline, video=True, tile=None),
        "wan-i2v": Family(conftest.tiny_wan_i2v_pipeline, image=True, video=True, tile=None),
        # sides of 32: the 2.2 VAE's 16x compression times the transformer's 2x2 patches
        "wan-ti2v": Family(conftest.tiny_wan_ti2v_pipeline, image=True, video=True, text_row=True, size=32, tile=None),
        "inpaint": Family(_inpainting, image=True, mask=True),
    }


FAMILY_NAMES = ["sd", "sdxl", "sd3", "flux", "kontext", "qwen-image", "qwen-image-edit", "z-image", "wan", "wan-i2v",
                "wan-ti2v", "inpaint"]

# The engine's documented modes, each a factor of the matrix; the first value is the plain engine's
FACTORS: dict[str, list[Any]] = {
    "family": FAMILY_NAMES,
    "decode": ["loop", "stage", "workers"],
    "encode": ["loop", "stage", "workers"],
    "core": ["thread", "process"],
    "async_scheduling": [False, True],
    "result_cache": [False, True],
    "lora": [False, True],
    "step_cache": [False, True],
    "group": ["none", "cfg", "sp"],
    "graphs": [False, True],
    "compile": [False, True],
    "quantization": [False, True],
    "vae_tiling": [False, True],
    "running_pixels": [False, True],
    "priority": [False, True],
    "batching": ["step", "request"],
    "controlnet": [False, True],
}

# What a value costs a cell, roughly in seconds of a loaded 2-core machine: processes to start
COSTS = {("decode", "workers"): 8, ("encode", "workers"): 8, ("core", "process"): 10, ("group", "cfg"): 10,
         ("group", "sp"): 10, ("compile", True): 4}

DEFAULT_CACHE = {"method": "first_block", "threshold": 0.5}
# r0 takes the engine's default_cache (first_block), r1 TaylorSeer, r2 none, r3 MagCache. TaylorSeer's factors in
# float32: in diffusers' default bfloat16, a last-bit difference between two batch compositions (another matmul
# blocking) can round a factor to its neighbouring bfloat16 value, 4e-3 away, past this matrix's 1e-5
# r0 takes the first controlnet for the first half of its steps, r2 the second for one step: forwards with two
# control groups, with one, and without (which a CUDA graph replays)
CONTROLS = [{"name": "edges", "scale": 0.9, "end": 0.5}, None, {"name": "depth", "scale": 0.6, "start": 0.25,
                                                                  "end": 0.5}]
CACHES = [{"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1,
           "taylor_factors_dtype": "float32"}, None,
          {"method": "mag", "mag_ratios": [1.0] * STEPS, "num_inference_steps": STEPS, "threshold": 0.5}]


def engine_options(row: dict[str, Any], family: Family, loras: dict[str, str],
                   nets: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine's keyword arguments for a cell (the graph emulator is no argument: run_cell installs it).
    `nets`: the controlnets a cell with controlnet on loads."""
    options: dict[str, Any] = {
        "decode_stage": row["decode"] != "loop", "decode_workers": int(row["decode"] == "workers"),
        "encode_stage": row["encode"] != "loop", "encode_workers": int(row["encode"] == "workers"),
        "engine_core_process": row["core"] == "process", "async_scheduling": row["async_scheduling"],
    }
    if row["result_cache"]:
        options["result_cache_mb"] = 16
    options.update(image_options(row, family, loras, nets))
    if row["group"] == "cfg":
        options["cfg_parallel_size"] = 2
    elif row["group"] == "sp":
        options["sequence_parallel_size"] = 2
    if row["compile"]:
        options.update(compile="dynamic", compile_backend="eager")  # dynamo's tracing, without inductor's build
    if row["priority"]:
        options["scheduling_policy"] = "priority"
    if row["batching"] != "step":  # with the window request-level servers gather a batch in
        options.update(batching=row["batching"], request_batch_wait_s=0.05)
    return options


def image_options(row: dict[str, Any], family: Family, loras: dict[str, str],
                  nets: dict[str, str] | None = None) -> dict[str, Any]:
    """The options that change images by design: the plain engine of a cell has these too."""
    options: dict[str, Any] = {}
    if row["lora"]:
        options["lora_modules"] = dict(loras)
    if row["controlnet"]:
        options["controlnets"] = dict(nets or {})
    if row["step_cache"]:
        options["default_cache"] = DEFAULT_CACHE
    if row["quantization"]:
        options["quantization"] = "torchao:int8wo"
    if row["vae_tiling"]:
        options["vae_tiling"] = True
        if family.tile is not None:
            options["vae_tile_size"] = family.tile
    return options


@dataclass
class Job:
    """A request of a cell's batch. `after`: sent once that request has taken a step ("victim") or once the
    others have finished ("done")."""

    name: str
    prompt: str
    params: SamplingParams
    after: str | None = None


def picture(seed: int, side: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def control_picture(seed: int) -> Image.Image:
    """An edge-map-like control image of another size than the requests' (resized to theirs)."""
    edges = np.random.default_rng(seed).random((26, 30, 3)) > 0.7
    return Image.fromarray(edges.astype(np.uint8) * 255)


def inpaint_mask(side: int) -> Image.Image:
    mask = np.zeros((side, side), dtype=np.uint8)
    mask[side // 4: 3 * side // 4, side // 8: 5 * side // 8] = 255
    return Image.fromarray(mask)


def jobs_for(row: dict[str, Any], family: Family) -> list[Job]:
    """The cell's batch: CFG and no CFG, n=2, other seeds and texts, and what the cell's modes put in requests."""
    side = family.side
    common: dict[str, Any] = dict(num_inference_steps=STEPS, height=side, width=side, output_type="np")
    if family.video:
        common["num_frames"] = 5
    specs = [("r0", "a red cat on a mat", dict(guidance_scale=5.0, seed=1, negative_prompt="blurry", n=2)),
             ("r1", "x", dict(guidance_scale=1.0, seed=2)),
             ("r2", "a blue dog", dict(guidance_scale=4.0, seed=3))]
    jobs = []
    for i, (name, prompt, own) in enumerate(specs):
        params = {**common, **own}
        if family.image and not (family.text_row and i == 1):
            params["image"] = picture(10 + i, side)
        if family.mask:
            params["mask_image"] = inpaint_mask(side)
        if row["lora"]:
            params["loras"] = [{"l": 0.8}, {"l": 0.3, "m": -0.5}, None][i]
        if row["step_cache"]:
            params["cache"] = "default" if i == 0 else CACHES[i - 1]
        if row["controlnet"] and CONTROLS[i] is not None:
            params["controls"] = [{**CONTROLS[i], "image": control_picture(20 + i)}]
        jobs.append(Job(name, prompt, SamplingParams(**params)))
    if row["step_cache"]:  # the last cache method beside them
        jobs.append(Job("r3", "a green star", dataclasses.replace(jobs[2].params, seed=4, cache=CACHES[2])))
    if row["priority"]:  # r0 runs alone first, least urgent; the rest arrive while it runs and preempt it
        victim = jobs[0]
        victim.params = dataclasses.replace(victim.params, priority=1, num_inference_steps=family.victim_steps)
        for job in jobs[1:]:
            job.after = "victim"
        jobs.append(Job("hi", "urgent", dataclasses.replace(jobs[1].params, seed=9, priority=-1), after="victim"))
    if row["result_cache"]:  # asked again once answered: the result cache's copy
        jobs.append(Job("again", jobs[1].prompt, jobs[1].params, after="done"))
    return jobs


def victim_rows(jobs: list[Job], family: Family) -> int:
    """r0's denoiser rows (n=2, with CFG where the family runs it), the most of any request of the batch."""
    return jobs[0].params.n * (2 if family.cfg else 1)


def pixels_bound(jobs: list[Job], family: Family) -> int:
    """max_running_pixels at r0's pixels, the largest request's: requests run one at a time."""
    frames = 5 if family.video else 1
    return victim_rows(jobs, family) * frames * jobs[0].params.height * jobs[0].params.width


@dataclass
class CellResult:
    outputs: dict[str, Any]  # job name -> final RequestOutput
    stats: dict[str, Any] = field(default_factory=dict)


async def _collect(engine: AsyncDiffusionEngine, job: Job, started: asyncio.Event | None = None) -> Any:
    final = None
    async for out in engine.generate(job.prompt, job.params, request_id=job.name):
        if started is not None and not out.finished:
            started.set()
        final = out
    if started is not None:
        started.set()  # (finished without a progress output: the waiters must not hang)
    return final


async def _run_jobs(engine: AsyncDiffusionEngine, jobs: list[Job]) -> dict[str, Any]:
    engine.start()
    victim_started = asyncio.Event()
    first = [j for j in jobs if j.after is None]
    tasks = {j.name: asyncio.create_task(_collect(engine, j, victim_started if j.name == "r0" else None))
             for j in first}
    later = [j for j in jobs if j.after == "victim"]
    if later:
        await victim_started.wait()
        tasks.update({j.name: asyncio.create_task(_collect(engine, j)) for j in later})
    outputs = {name: await task for name, task in tasks.items()}
    for job in (j for j in jobs if j.after == "done"):
        outputs[job.name] = await _collect(engine, job)
    return outputs


def run_cell(model: str, row: dict[str, Any], family: Family, jobs: list[Job], loras: dict[str, str],
             install_graphs: Callable[[Any], None], nets: dict[str, str] | None = None) -> CellResult:
    """Starts the cell's engine, runs its batch, shuts it down."""
    options = engine_options(row, family, loras, nets)
    if row["running_pixels"]:
        options["max_running_pixels"] = pixels_bound(jobs, family)
    if row["priority"]:  # a batch of the victim's rows only: whatever arrives must preempt it
        options["max_batch_size"] = victim_rows(jobs, family)

    async def run() -> CellResult:
        engine = AsyncDiffusionEngine(model=model, device="cpu", dtype="float32", **options)
        try:
            if row["graphs"]:
                install_graphs(engine.engine)
            outputs = await asyncio.wait_for(_run_jobs(engine, jobs), DEADLINE_S)
            return CellResult(outputs, engine.stats())
        finally:
            await engine.shutdown(5)

    return asyncio.run(run())


class References:
    """The plain engine's images, one engine per (family, image options), kept for the module."""

    def __init__(self) -> None:
        self._engines: dict[tuple, DiffusionEngine] = {}
        self._images: dict[tuple, list[np.ndarray]] = {}
        self._ids = itertools.count()

    def images(self, model: str, row: dict[str, Any], family: Family, loras: dict[str, str],
               job: Job, nets: dict[str, str] | None = None) -> list[np.ndarray]:
        options = image_options(row, family, loras, nets)
        key = (model, *sorted((k, repr(v)) for k, v in options.items()))
        params = dataclasses.replace(job.params, priority=0, output_kind="final")
        request_key = (key, job.prompt, repr(params))
        if request_key not in self._images:
            engine = self._engines.get(key)
            if engine is None:
                engine = self._engines[key] = DiffusionEngine(model=model, device="cpu", dtype="float32",
                                                              **options)
            out = engine.generate(job.prompt, params, use_tqdm=False)[0]
            assert out.error is None, f"the plain engine failed: {out.error}"
            self._images[request_key] = [np.asarray(image) for image in out.images]
        return self._images[request_key]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


class Models:
    """Each family's tiny pipeline saved once (and two LoRA adapters and two controlnets for it), built when first
    asked for."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.families = _families()
        self._paths: dict[str, str] = {}
        self._pipes: dict[str, Any] = {}  # the pipelines as built: adapters are made on them
        self._loras: dict[str, dict[str, str]] = {}
        self._nets: dict[str, dict[str, str]] = {}

    def path(self, name: str) -> str:
        if name not in self._paths:
            folder = self.root / name
            self._pipes[name] = self.families[name].build()
            self._pipes[name].save_pretrained(folder)
            self._paths[name] = str(folder)
        return self._paths[name]

    def loras(self, name: str) -> dict[str, str]:
        if name not in self._loras:
            from lora_utils import make_lora

            self.path(name)
            self._loras[name] = {adapter: make_lora(self._pipes[name], str(self.root / f"{name}-lora-{adapter}"),
                                                    seed=seed) for seed, adapter in enumerate(("l", "m"))}
        return self._loras[name]

    def controlnets(self, name: str) -> dict[str, str]:
        """Two tiny ControlNetModels of the family's UNet, with random weights (SD and SDXL take them)."""
        if name not in self._nets:
            from test_controlnet import tiny_controlnet

            self.path(name)
            self._nets[name] = {}
            for seed, net in enumerate(("edges", "depth")):
                folder = self.root / f"{name}-controlnet-{net}"
                tiny_controlnet(self._pipes[name].unet, seed=30 + seed).save_pretrained(folder)
                self._nets[name][net] = str(folder)
        return self._nets[name]
