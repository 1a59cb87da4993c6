"""Errors the engine raises for conditions that are not bad input (those are ValueError)."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_num_waiting requests; retry later (HTTP 429)."""
