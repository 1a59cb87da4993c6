"""`python -m dvllm.build_ops`: report dvllm's kernels, and in a source checkout build them ahead of time.

An installed dvllm carries its kernels (`dvllm/_C*.so`, compiled when the package was built): this loads them and
reports what they are. A source checkout (an editable install whose library is missing or out of date, a Ray node
running from the tree) builds them into its environment's build directory, where the first use finds them, so a
GPU image or a Ray node starts without compiling; `--cuda on` builds the CUDA kernels on a machine without a GPU
(nvcc and a CUDA build of torch), for TORCH_CUDA_ARCH_LIST or dvllm's default architectures. --print-layout
prints, as JSON, where the kernels came from and the coefficient layout and CUDA architectures each library was
compiled with. Imports torch and dvllm's build only, so it runs in an environment that has nothing else.
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
                        help="Source checkouts: build the CUDA kernels (auto: when torch is a CUDA build and nvcc is "
                             "found, the default).")
    parser.add_argument("--print-layout", action="store_true",
                        help="Print where the kernels came from, the coefficient layout each library reports, and "
                             "sampler_coeffs.py's, as JSON.")
    parser.add_argument("--verbose", action="store_true", help="Show the compiler's commands and output.")
    args = parser.parse_args(argv)
    possible = _extension.cuda_build_possible()
    if args.cuda == "on" and not possible:
        parser.error("--cuda on needs a CUDA build of torch and nvcc (CUDA_HOME); "
                     f"torch {torch.__version__} has CUDA {torch.version.cuda}")
    with_cuda = args.cuda == "on" or (args.cuda == "auto" and possible)
    library, why_not = _extension.packaged_library(want_cuda=with_cuda)
    start = time.perf_counter()
    if library is not None or not _extension.source_checkout():
        status = _extension.custom_ops_status()  # nothing to build: the package's library, or none
        if not status.kernels:
            print(f"dvllm custom ops: none loaded: {status.reason}", file=sys.stderr)
            return 1
        kernels, source, where = status.kernels, status.source, status.library
    else:
        try:
            build_dir = _extension.build(with_cuda, verbose=args.verbose)
        except Exception as e:
            print(f"dvllm custom ops: the build failed: {type(e).__name__}: {_extension._tail(str(e))}",
                  file=sys.stderr)
            return 1
        kernels, source, where = ("cpu", "cuda") if with_cuda else ("cpu",), "jit", f"{build_dir} ({why_not})"
    print(f"dvllm custom ops: {' and '.join(kernels)} kernels ({source}) in {where} "
          f"({time.perf_counter() - start:.0f} s)",
          file=sys.stderr)
    if args.print_layout:
        cuda = "cuda" in kernels
        report = {"expected": layout(), "source": source,
                  "cpu": list(torch.ops.dvllm.coeff_layout()),
                  "cuda": list(torch.ops.dvllm.cuda_coeff_layout()) if cuda else None,
                  "cuda_archs": list(torch.ops.dvllm.cuda_archs()) if cuda else None, "library": where}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
