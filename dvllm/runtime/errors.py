"""Errors that cross a process boundary: the other side's exception as it was where it can be pickled, else a
RemoteError that keeps its type's name, message and traceback text."""
from __future__ import annotations

import pickle
import traceback


class RemoteError(RuntimeError):
    """An exception raised on the other side of a channel: str() is "Type: message", as the other side would log
    it; `remote_traceback` is its traceback there."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.remote_traceback = type_name, message, remote_traceback

    def __reduce__(self) -> tuple:
        return RemoteError, (self.type_name, self.message, self.remote_traceback)

    @classmethod
    def of(cls, error: BaseException) -> RemoteError:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(type(error).__name__, str(error), text)


class ProcessLost(RuntimeError):
    """The other side died (killed, or crashed) or passed its call's bound before answering."""


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (it may cross a channel), else a RuntimeError that says it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception class with a constructor pickle cannot call
        return RuntimeError(f"{type(error).__name__}: {error}")
