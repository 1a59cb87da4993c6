"""dvllm packaging. Requirements live in requirements/ (one file per target)."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


setup(
    name="dvllm",
    version="0.1.0",
    description="A serving engine for diffusion image models, built the way vLLM serves LLMs.",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dvllm", "dvllm.*"]),
    package_data={"dvllm.models.presets": ["*.json"],
                  "dvllm.models": ["builtin/*/*.json", "builtin/*/*/*.json", "builtin/*/*/*.txt",
                                   "builtin/*/*/*.safetensors"],
                  "dvllm.entrypoints": ["static/*"]},
    # torch>=2.6 is met by the CPU build installed first (README) or pulls PyPI's CUDA build.
    install_requires=["torch>=2.6", *read_requirements("common.txt")],
    extras_require={
        "test": read_requirements("test.txt"),  # one list: requirements/test.txt
        "bench": ["httpx>=0.27", "matplotlib>=3.8"],
        "ray": ["ray>=2.40"],
        "xformers": ["xformers>=0.0.28"],
        # --quantization (diffusers wants torchao >= 0.15); bitsandbytes (CUDA only) is installed on its own
        "quantization": ["torchao>=0.15.0", "optimum-quanto>=0.2.7", "gguf>=0.10.0"],
    },
)
