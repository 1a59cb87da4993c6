"""dvllm packaging. Requirements live in requirements/ (one file per target).

The kernels in csrc/ are compiled into the package (dvllm/_C.<suffix>.so) with torch's BuildExtension: the CPU
kernels always, the CUDA kernels too when torch is a CUDA build and nvcc is found (TORCH_CUDA_ARCH_LIST, default
8.0;9.0+PTX). A wheel then names the torch it was built against. Without torch at build time, the package has no
kernels and dvllm runs its pure-torch reference ops (it says so at start).
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


# What install_requires holds already (torch, common.txt): an extra that includes them adds nothing.
BASE_REQUIREMENTS = ("cpu.txt", "cuda.txt", "common.txt")


def read_requirements(name: str) -> list[str]:
    """The file's requirements, and those of the files it includes (`-r`), but the base ones."""
    found = []
    for line in (HERE / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            included = line[2:].strip()
            if included not in BASE_REQUIREMENTS:
                found += read_requirements(included)
        elif line:
            found.append(line)
    return found


def load_by_path(name: str):
    """A module of dvllm, without importing the package (its __init__, its dependencies)."""
    spec = importlib.util.spec_from_file_location(f"_dvllm_setup_{name}", HERE / "dvllm" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kernels() -> tuple[list, dict, str]:
    """(ext_modules, cmdclass, the torch requirement)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("dvllm: torch is not importable at build time; the package gets no kernels", file=sys.stderr)
        return [], {}, "torch>=2.6"
    sources, coeffs = load_by_path("kernel_sources"), load_by_path("sampler_coeffs")
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", sources.CUDA_ARCHS) if with_cuda else None
    header = coeffs.c_header()
    info = sources.build_info(sources.source_digest(HERE / "csrc", header), torch.__version__, coeffs.layout(),
                              torch.version.cuda if with_cuda else None, archs)
    files = [*sources.CPU_SOURCES, sources.MODULE_SOURCE, *(sources.CUDA_SOURCES if with_cuda else ())]
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    ext = kind("dvllm._C", [f"csrc/{f}" for f in files], extra_link_args=list(sources.LDFLAGS),
               # -g0: Python's default flags ask for debug info, which makes the library 20x larger
               extra_compile_args={"cxx": [*sources.cxx_flags(header), "-g0"], "nvcc": sources.nvcc_flags(header)})

    class BuildKernels(cpp_extension.BuildExtension):
        """Generates the headers (coefficient layout, build info) into the build's temp dir, then compiles."""

        def build_extensions(self) -> None:
            include = sources.write_headers(Path(self.build_temp).resolve() / "dvllm_include", header, info)
            for extension in self.extensions:
                extension.include_dirs.append(str(include))
            super().build_extensions()

    # The library is bound to this torch's C++ ABI: the wheel asks for the same release (any local build of it,
    # e.g. 2.13.0+cpu, as vLLM pins torch); loading checks the build (CUDA kernels need torch's CUDA).
    return [ext], {"build_ext": BuildKernels}, f"torch=={torch.__version__.split('+')[0]}"


ext_modules, cmdclass, torch_requirement = kernels()

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
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[torch_requirement, *read_requirements("common.txt")],
    extras_require={
        "dev": read_requirements("dev.txt"),  # the fast tier's set: `pytest -m "not slow"`
        "test": read_requirements("test.txt"),  # the whole suite (CI): dev's, Ray, the browser, quantization
        "bench": ["httpx>=0.27", "matplotlib>=3.8"],
        "ray": ["ray>=2.40"],
        "xformers": ["xformers>=0.0.28"],
        # --quantization (diffusers wants torchao >= 0.15); bitsandbytes (CUDA only) is installed on its own
        "quantization": ["torchao>=0.15.0", "optimum-quanto>=0.2.7", "gguf>=0.10.0"],
    },
)
