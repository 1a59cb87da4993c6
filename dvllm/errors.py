"""Errors the engine raises for conditions that are not bad input (those are ValueError)."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_num_waiting requests; retry later (HTTP 429)."""


class NoWorkerError(RuntimeError):
    """Every worker is dead and none will come back; the engine cannot run requests (HTTP 503)."""
