"""Which adapters the worker has read into its host memory: the scheduler's view, so that no step reads a file.

An adapter crosses to the worker as an id (lora/ref.py); the worker reads its file (and checks the file's digest)
on a thread of its own, off the step loop, when the scheduler asks. While requests run, a request whose adapters
are neither in a LoRA slot nor read waits, and they are asked for, while the others go on; the step that loads it
into a slot then copies weights already in host memory. With none running, no one's step would wait for a read:
the step that loads the adapter reads it (unless a read of it is under way: that one is waited for, off the loop). The worker reports each read that ended (well or not: a failed one fails
its requests at the load, naming why) and each adapter its host cache let go.
"""
from __future__ import annotations

from dvllm.core.lora_slots import LoraSlots
from dvllm.lora.ref import LoraRef  # (no torch: dvllm.core imports none, a test checks)


class LoraReads:
    def __init__(self, cache_size: int) -> None:
        # at most half the worker's host cache asked for at once: reads ahead must not push out those not yet used
        self.max_asked = max(1, cache_size // 2)
        self.clear()

    def clear(self) -> None:
        """A new worker: it has read nothing, and nothing was asked of it."""
        self.read: set[str] = set()             # digests the worker holds read (its last reports)
        self.asked: dict[str, LoraRef] = {}     # digests asked for and not yet reported
        self._to_send: list[LoraRef] = []

    def must_wait(self, adapters: list[LoraRef], slots: LoraSlots, running: bool) -> bool:
        """Whether a request with these adapters waits for reads (asking for them, as far as max_asked allows, where
        requests are `running`)."""
        waits = False
        for ref in adapters:
            if ref.digest in self.read or ref.digest in slots.digest:
                continue
            if ref.digest in self.asked or running:
                waits = True
            if running and ref.digest not in self.asked and len(self.asked) < self.max_asked:
                self.asked[ref.digest] = ref
                self._to_send.append(ref)
        return waits

    def take(self) -> list[LoraRef]:
        """The reads to send with this step."""
        send, self._to_send = self._to_send, []
        return send

    @property
    def pending(self) -> bool:
        return bool(self.asked)

    def update(self, read: list[str], dropped: list[str]) -> None:
        """The worker's report: reads that ended, adapters its host cache let go."""
        for digest in read:
            self.asked.pop(digest, None)
            self.read.add(digest)
        self.read.difference_update(dropped)
