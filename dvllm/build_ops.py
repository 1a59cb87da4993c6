"""`python -m dvllm.build_ops`: build dvllm's custom ops ahead of time.

Into torch's extensions directory (TORCH_EXTENSIONS_DIR), where the first use finds them: a GPU image or a
Ray node then starts without compiling. A machine without a GPU can build the CUDA kernels too (`--cuda on`,
with nvcc and a CUDA build of torch), for TORCH_CUDA_ARCH_LIST or dvllm's default architectures. Prints what it
built and, with --print-layout, the coefficient layout each kernel library was compiled with, as JSON.
Imports torch and dvllm's build only, so it runs in an environment that has nothing else.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dvllm import _extension
from dvllm.sampler_coeffs import layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dvllm.build_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", choices=("auto", "on", "off"), default="auto",
                        help="Build the CUDA kernels: auto when torch is a CUDA build and nvcc is found (default).")
    parser.add_argument("--print-layout", action="store_true",
                        help="Print the coefficient layout each built library reports, and sampler_coeffs.py's.")
    parser.add_argument("--verbose", action="store_true", help="Show the compiler's commands and output.")
    args = parser.parse_args(argv)
    possible = _extension.cuda_build_possible()
    if args.cuda == "on" and not possible:
        parser.error("--cuda on needs a CUDA build of torch and nvcc (CUDA_HOME); "
                     f"torch {torch.__version__} has CUDA {torch.version.cuda}")
    with_cuda = args.cuda == "on" or (args.cuda == "auto" and possible)
    start = time.perf_counter()
    try:
        build_dir = _extension.build(with_cuda, verbose=args.verbose)
    except Exception as e:
        print(f"dvllm custom ops: the build failed: {type(e).__name__}: {_extension._tail(str(e))}", file=sys.stderr)
        return 1
    kernels = "CPU and CUDA" if with_cuda else "CPU"
    print(f"dvllm custom ops: {kernels} kernels built in {build_dir} ({time.perf_counter() - start:.0f} s)",
          file=sys.stderr)
    if args.print_layout:
        report = {"expected": layout(), "cpu": list(torch.ops.dvllm.coeff_layout()),
                  "cuda": list(torch.ops.dvllm.cuda_coeff_layout()) if with_cuda else None,
                  "cuda_archs": list(torch.ops.dvllm.cuda_archs()) if with_cuda else None,
                  "library": str(build_dir / f"{_extension.NAME}.so")}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
