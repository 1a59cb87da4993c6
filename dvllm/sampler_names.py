"""The names a request may give as its sampler, without importing diffusers: the command line checks them
before anything heavy loads (dvllm/samplers/registry.py says what each one builds)."""
from __future__ import annotations

import difflib
from typing import Any, Iterable

# A short name means exactly `Class.from_config(model_scheduler_config, **overrides)`.
SHORT_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp_2m_karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "lcm": ("LCMScheduler", {}),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


def scheduler_class(name: str) -> Any:
    """The diffusers scheduler class of that name, or None (diffusers is imported here, on first use)."""
    if not name.endswith("Scheduler"):  # diffusers' lazy module would import whatever name it is asked for
        return None
    import diffusers
    from diffusers import SchedulerMixin

    cls = getattr(diffusers, name, None)
    if isinstance(cls, type) and issubclass(cls, SchedulerMixin):
        return cls
    return None


def did_you_mean(name: object, names: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the nearest of `names` (case aside), or ""."""
    names = list(names)
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(by_lower[c]) for c in close)}?" if close else ""
