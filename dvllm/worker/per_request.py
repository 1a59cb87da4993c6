"""Failures pinned on the request that caused them: a batched call that raises is retried item by item."""
from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


def per_request(items: list[T], run: Callable[[list[T]], None], errors: dict, what: str,
                 key: Callable[[T], Any] = lambda s: s.request_id,
                 checkpoint: Callable[[list[T]], Callable[[], None]] | None = None) -> None:
    """Run on the whole group; if that raises, run on each item alone and fail only those that raise.
    `checkpoint(items)` returns what puts the items back as they were before the failed group run."""
    restore = checkpoint(items) if checkpoint is not None and len(items) > 1 else None
    try:
        run(items)
        return
    except Exception as e:
        if len(items) == 1:
            _fail(errors, key(items[0]), what, e)
            return
    if restore is not None:
        restore()
    for item in items:
        try:
            run([item])
        except Exception as e:
            _fail(errors, key(item), what, e)


def _fail(errors: dict, item_key: Any, what: str, error: Exception) -> None:
    """The request's error, and its traceback in the log: the request's answer names the failure, the operator's
    log says where it came from."""
    logger.error("%s failed for request %s", what, item_key, exc_info=error)
    errors[item_key] = f"{what} failed: {type(error).__name__}: {error}"
