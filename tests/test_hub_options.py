"""Hub options (LoadConfig): --revision, --variant, --download-dir, --local-files-only. Offline: a Hub cache laid
out as huggingface_hub lays it out, holding one revision of a tiny pipeline whose weights exist in the fp16
variant only, so a load that wanted any other weight file would fail."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_sd_pipeline
from diffusers import StableDiffusionPipeline

from dvllm import DiffusionEngine, SamplingParams

REPO = "dvllm-tests/tiny-sd"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> str:
    """models--dvllm-tests--tiny-sd with refs/v1 -> one snapshot: configs, tokenizers, *.fp16.safetensors."""
    cache = tmp_path_factory.mktemp("hub-cache")
    repo = cache / "models--dvllm-tests--tiny-sd"
    snapshot = repo / "snapshots" / COMMIT
    tiny_sd_pipeline().save_pretrained(snapshot, variant="fp16")
    assert list(snapshot.rglob("*.fp16.safetensors")) and not [
        p for p in snapshot.rglob("*.safetensors") if ".fp16." not in p.name]
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(COMMIT)
    return str(cache)


def test_a_revision_and_variant_load_from_the_cache_alone(hub_cache):
    engine = DiffusionEngine(model=REPO, revision="v1", variant="fp16", download_dir=hub_cache, local_files_only=True,
                             device="cpu", dtype="float32")
    params = SamplingParams(num_inference_steps=3, seed=2, height=16, width=16, output_type="np")
    got = engine.generate(["a red circle"], [params], use_tqdm=False)[0]
    assert got.error is None and engine.loaded_model.name == REPO
    snapshot = f"{hub_cache}/models--dvllm-tests--tiny-sd/snapshots/{COMMIT}"
    pipe = StableDiffusionPipeline.from_pretrained(snapshot, variant="fp16", safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    want = pipe("a red circle", num_inference_steps=3, height=16, width=16, output_type="np",
                generator=torch.Generator("cpu").manual_seed(2)).images[0]
    np.testing.assert_allclose(got.images[0], want, atol=1e-3, rtol=0)


def test_without_the_variant_or_at_another_revision_nothing_is_fetched(hub_cache, tmp_path):
    common = dict(model=REPO, download_dir=hub_cache, local_files_only=True, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="with no variant .*no file named"):  # the component diffusers loads first names it
        DiffusionEngine(revision="v1", **common)  # in the cache, and the Hub is not asked
    with pytest.raises(ValueError, match="could not be fetched from the Hugging Face Hub"):
        DiffusionEngine(revision="v2", variant="fp16", **common)  # no such revision in the cache
    empty = tmp_path / "empty-cache"
    shutil.copytree(hub_cache, empty)
    shutil.rmtree(empty / "models--dvllm-tests--tiny-sd" / "snapshots")
    with pytest.raises(ValueError, match="could not be fetched"):
        DiffusionEngine(**{**common, "download_dir": str(empty)}, revision="v1", variant="fp16")
