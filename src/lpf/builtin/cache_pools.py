"""Reference-counted pools of KV blocks and state slots that keep content hashes (prefix caching).

Never imports torch (the scheduler uses them). Used instead of `kv_cache.BlockAllocator` and
`state_cache.SlotPool` when prefix caching is on; with it off the engine keeps those (their exact
allocation order is what the other drills are measured on).

Both pools work as vLLM's block pool does: every id starts in a free queue (in id order); an id whose
reference count drops to 0 goes to the queue's tail but keeps its published hash, so a later request
can still hit it; allocation takes from the head and evicts whatever hash the id still carries (the
least recently freed go first). A hit "touches" an id: one more reference, and out of the free queue
so nothing evicts it while it is read. `publish(id, h)` names the id's content by `h` unless another
id already holds `h` (the first one stays: two requests that computed the same prefix share one copy).

`CachingSlotPool` also records `ever_used` (a slot here held some earlier request's state) like
`SlotPool`, for the drills that read a reused slot.
"""

from __future__ import annotations

from collections import OrderedDict


class _HashedPool:
    kind = "id"

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"need at least one {self.kind}")
        self.n = n
        self.ref = [0] * n
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))
        self.hash_of: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.evicted = 0  # cached ids reused for something else

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take(self) -> int:
        i, _ = self._free.popitem(last=False)
        self.ref[i] = 1
        h = self.hash_of.pop(i, None)
        if h is not None:
            if self.by_hash.get(h) == i:
                del self.by_hash[h]
            self.evicted += 1
            self._evicted(i, h)
        return i

    def _evicted(self, i: int, h: int) -> None:
        """Hook: an id that carried hash `h` is being reused."""

    def touch(self, i: int) -> None:
        self.ref[i] += 1
        self._free.pop(i, None)

    def release(self, i: int) -> None:
        if self.ref[i] <= 0:
            raise RuntimeError(f"{self.kind} {i} released with no reference held")
        self.ref[i] -= 1
        if self.ref[i] == 0:
            self._free[i] = None

    def publish(self, i: int, h: int) -> bool:
        """Name id i's content by hash h; False (nothing changed) when h is already held by another id."""
        if h in self.by_hash:
            return self.by_hash[h] == i
        old = self.hash_of.get(i)
        if old is not None and self.by_hash.get(old) == i:
            del self.by_hash[old]
        self.by_hash[h] = i
        self.hash_of[i] = h
        return True

    def cached(self, h: int) -> int | None:
        return self.by_hash.get(h)


class CachingBlockPool(_HashedPool):
    """KV block ids; `allocate(n)` / `free(blocks)` as `BlockAllocator`, plus hashes and references."""

    kind = "KV block"

    @property
    def num_blocks(self) -> int:
        return self.n

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._take() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        # in reverse: a request's tail blocks reach the queue first and are evicted before its prefix
        for b in reversed(blocks):
            self.release(b)


class CachingSlotPool(_HashedPool):
    """State slot ids; `allocate()` / `unallocate(slot)` / `free(slot)` as `SlotPool`, plus hashes
    and references (a published checkpoint is a slot whose hash names the state at a boundary)."""

    kind = "state slot"

    def __init__(self, n: int, on_evict=None):
        super().__init__(n)
        self.ever_used: set[int] = set()
        self.on_evict = on_evict or (lambda slot, h: None)

    @property
    def num_slots(self) -> int:
        return self.n

    def _evicted(self, i: int, h: int) -> None:
        self.on_evict(i, h)

    def allocate(self) -> int | None:
        return self._take() if self._free else None

    def unallocate(self, slot: int) -> None:
        """Return a slot that was allocated but never used (admission fell through): back to the head."""
        self.ref[slot] = 0
        self._free[slot] = None
        self._free.move_to_end(slot, last=False)

    def free(self, slot: int) -> None:
        self.ever_used.add(slot)
        self.release(slot)
