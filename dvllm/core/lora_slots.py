"""Which adapters are resident in a worker's LoRA slots (max_loras of them): the scheduler's view.

A running request pins its adapters' slots; an adapter in use is never evicted. Admission puts a
missing adapter into a free slot, or evicts the least recently used adapter no running request uses;
the worker reads the adapter (by its id) into the slot before the step that first needs it. A request whose
adapters cannot all be placed waits, and other requests go on. Adapters are known by the digest of their
file: two names for one file share a slot.
"""
from __future__ import annotations

from dvllm.lora.ref import LoraRef  # (no torch: dvllm.core imports none, a test checks)


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.digest: list[str | None] = [None] * num_slots
        self.users = [0] * num_slots      # running requests using each slot's adapter
        self.last_used = [0] * num_slots  # iteration it was last released or placed (LRU)
        self.loads = 0                    # adapters copied into slots, over the worker's life

    def can_place(self, adapters: list[LoraRef]) -> bool:
        return self.shortfall(adapters) <= 0

    def shortfall(self, adapters: list[LoraRef]) -> int:
        """Slots missing for placing `adapters` now: adapters not resident, less idle slots that hold none
        of them (an idle slot holding one of them is reused, not free for the others)."""
        wanted = {ref.digest for ref in adapters}
        missing = sum(1 for digest in wanted if digest not in self.digest)
        free = sum(1 for digest, users in zip(self.digest, self.users) if users == 0 and digest not in wanted)
        return missing - free

    def freed_by(self, adapters_of_victims: list[LoraRef]) -> int:
        """Slots that would become idle if the running requests holding these adapters left."""
        held: dict[str, int] = {}
        for ref in adapters_of_victims:
            held[ref.digest] = held.get(ref.digest, 0) + 1
        return sum(1 for digest, users in zip(self.digest, self.users) if users and held.get(digest, 0) == users)

    def acquire(self, adapters: list[LoraRef], iteration: int) -> list[tuple[int, LoraRef]]:
        """Pins the adapters' slots; returns the (slot, adapter) the worker must load first."""
        loads = []
        resident = [ref for ref in adapters if ref.digest in self.digest]
        for ref in resident + [r for r in adapters if r.digest not in self.digest]:  # pin what is there first
            if ref.digest in self.digest:
                slot = self.digest.index(ref.digest)
            else:
                idle = [s for s in range(self.num_slots) if self.users[s] == 0]
                if not idle:
                    raise RuntimeError("no LoRA slot is free: admission should have waited")
                slot = min(idle, key=lambda s: (self.digest[s] is not None, self.last_used[s]))  # empty, else LRU
                self.digest[slot] = ref.digest
                loads.append((slot, ref))
                self.loads += 1
            self.users[slot] += 1
            self.last_used[slot] = iteration
        return loads

    def release(self, adapters: list[LoraRef], iteration: int) -> None:
        for ref in adapters:
            if ref.digest in self.digest:  # else its load failed and the slot was forgotten
                slot = self.digest.index(ref.digest)
                self.users[slot] -= 1
                self.last_used[slot] = iteration

    def forget(self, slot: int) -> None:
        """The worker could not load the slot's adapter: the slot is empty, and the requests that were to use
        it failed (they were all admitted with the load)."""
        self.digest[slot], self.users[slot] = None, 0

    @property
    def num_resident(self) -> int:
        return sum(digest is not None for digest in self.digest)
