"""A request's recent step times, and the estimate they give of the time its remaining steps take."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Steps the mean is taken over: recent enough to follow a batch that grows or shrinks, long enough to smooth
# one slow step (an admission's encode, another shape's turn)
WINDOW = 8


@dataclass(eq=False)
class StepPace:
    """Wall seconds between a request's step completions (its first: from its first scheduling), over the
    last WINDOW steps: its own pace, waits for other shapes' turns included."""

    durations: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last: float | None = None  # when its latest step (or its first scheduling) was

    def start(self, now: float) -> None:
        if self.last is None:
            self.last = now

    def record(self, now: float) -> None:
        if self.last is not None:
            self.durations.append(max(0.0, now - self.last))
        self.last = now

    def eta(self, steps_left: int) -> float | None:
        """Seconds its `steps_left` steps take at its mean recent pace; None before a step was measured."""
        if not self.durations:
            return None
        return max(0, steps_left) * sum(self.durations) / len(self.durations)

    def reset(self) -> None:
        self.durations.clear()
        self.last = None
