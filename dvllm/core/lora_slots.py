"""Which adapters are resident in a worker's LoRA slots (max_loras of them): the scheduler's view.

A running request pins its adapters' slots; an adapter in use is never evicted. Admission puts a
missing adapter into a free slot, or evicts the least recently used adapter no running request uses;
the worker copies the weights in before the step that first needs them. A request whose adapters
cannot all be placed waits, and other requests go on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the scheduler reads only .uid: dvllm.core imports no torch (a test checks)
    from dvllm.lora.weights import LoraWeights


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.uid: list[int | None] = [None] * num_slots
        self.users = [0] * num_slots      # running requests using each slot's adapter
        self.last_used = [0] * num_slots  # iteration it was last released or placed (LRU)
        self.loads = 0                    # adapters copied into slots, over the worker's life

    def can_place(self, adapters: list[LoraWeights]) -> bool:
        return self.shortfall(adapters) <= 0

    def shortfall(self, adapters: list[LoraWeights]) -> int:
        """Slots missing for placing `adapters` now: adapters not resident, less idle slots that hold none
        of them (an idle slot holding one of them is reused, not free for the others)."""
        wanted = {w.uid for w in adapters}
        missing = sum(1 for uid in wanted if uid not in self.uid)
        free = sum(1 for uid, users in zip(self.uid, self.users) if users == 0 and uid not in wanted)
        return missing - free

    def freed_by(self, adapters_of_victims: list[LoraWeights]) -> int:
        """Slots that would become idle if the running requests holding these adapters left."""
        held: dict[int, int] = {}
        for w in adapters_of_victims:
            held[w.uid] = held.get(w.uid, 0) + 1
        return sum(1 for uid, users in zip(self.uid, self.users) if users and held.get(uid, 0) == users)

    def acquire(self, adapters: list[LoraWeights], iteration: int) -> list[tuple[int, Any]]:
        """Pins the adapters' slots; returns the (slot, weights) the worker must load first."""
        loads = []
        resident = [w for w in adapters if w.uid in self.uid]
        for w in resident + [w for w in adapters if w.uid not in self.uid]:  # pin what is there before evicting
            if w.uid in self.uid:
                slot = self.uid.index(w.uid)
            else:
                idle = [s for s in range(self.num_slots) if self.users[s] == 0]
                if not idle:
                    raise RuntimeError("no LoRA slot is free: admission should have waited")
                slot = min(idle, key=lambda s: (self.uid[s] is not None, self.last_used[s]))  # empty, else LRU
                self.uid[slot] = w.uid
                loads.append((slot, w))
                self.loads += 1
            self.users[slot] += 1
            self.last_used[slot] = iteration
        return loads

    def release(self, adapters: list[LoraWeights], iteration: int) -> None:
        for w in adapters:
            if w.uid in self.uid:  # else its load failed and the slot was forgotten
                slot = self.uid.index(w.uid)
                self.users[slot] -= 1
                self.last_used[slot] = iteration

    def forget(self, slot: int) -> None:
        """The worker could not load the slot's adapter: the slot is empty, and the requests that were to use
        it failed (they were all admitted with the load)."""
        self.uid[slot], self.users[slot] = None, 0

    @property
    def num_resident(self) -> int:
        return sum(uid is not None for uid in self.uid)
