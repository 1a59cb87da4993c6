"""dvllm: a serving engine for diffusion image models, built the way vLLM serves LLMs."""
from dvllm.config import EngineConfig
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.engine.engine import DiffusionEngine
from dvllm.errors import QueueFullError
from dvllm.outputs import RequestMetrics, RequestOutput
from dvllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["AsyncDiffusionEngine", "DiffusionEngine", "EngineConfig", "QueueFullError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "__version__"]
