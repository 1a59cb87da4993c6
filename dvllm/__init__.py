"""dvllm: a serving engine for diffusion image models, built the way vLLM serves LLMs.

The public names are imported on first use, so that `import dvllm.<module>` of a light module (the
custom-op build, `python -m dvllm.build_ops`, in an environment that has torch only) does not import the
engine and the model libraries.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
_EXPORTS = {
    "AsyncDiffusionEngine": "dvllm.engine.async_engine",
    "DiffusionEngine": "dvllm.engine.engine",
    "EngineConfig": "dvllm.config",
    "QueueFullError": "dvllm.errors",
    "RequestMetrics": "dvllm.outputs",
    "RequestOutput": "dvllm.outputs",
    "SamplingParams": "dvllm.sampling_params",
}
__all__ = ["AsyncDiffusionEngine", "DiffusionEngine", "EngineConfig", "QueueFullError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from dvllm.config import EngineConfig
    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.engine.engine import DiffusionEngine
    from dvllm.errors import QueueFullError
    from dvllm.outputs import RequestMetrics, RequestOutput
    from dvllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dvllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
