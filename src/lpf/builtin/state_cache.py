"""State slots for Mamba layers: an allocator (pure Python) and one flat buffer with explicit strides.

`SlotPool` hands out slot ids from a free queue: initially 0..N-1, freed slots go to the tail, so
successive allocations sweep upward through the ids before reusing low ones (as vLLM's block pool
does). That is what lets slot ids grow large under load, and what the seed's offset overflow needed.

`StateCache` stores every Mamba layer's conv and SSM state for every slot in ONE flat tensor. The
state of (slot, layer, part) starts at `slot * slot_stride + part_offset`: real offset arithmetic,
so an overflow in it (the `offset-wrap` drill: the prefill path computes `slot * slot_stride` modulo
2**bits) writes real data to the wrong place, exactly as a 32-bit offset in a kernel would.
The decode path always uses exact (64-bit) offsets, as in vLLM.
`part_dtypes` ({"conv": dtype, "ssm": dtype}) rounds a part to that dtype as it is written, as a
cache that stores it in that dtype would (vLLM's `mamba_cache_dtype` / `mamba_ssm_cache_dtype`); a
part whose dtype is the buffer's is stored as it is.
"""

from __future__ import annotations

from collections import deque
from math import prod


class SlotPool:
    """Free-queue allocator of state slot ids. Never imports torch (the scheduler uses it)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("need at least one state slot")
        self.num_slots = num_slots
        self._free = deque(range(num_slots))
        self._used: set[int] = set()
        self.ever_used: set[int] = set()  # a slot here holds some earlier request's state

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def unallocate(self, slot: int) -> None:
        """Return a slot that was allocated but never used (admission fell through): back to the head."""
        self._used.remove(slot)
        self._free.appendleft(slot)

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._used.remove(slot)
        self.ever_used.add(slot)
        self._free.append(slot)


class StateCache:
    """All Mamba state of all slots, in one flat buffer.

    `specs[layer]` lists the named parts of one Mamba layer's state, e.g.
    `[("conv", (conv_dim, d_conv - 1)), ("ssm", (n_heads, head_dim, d_state))]`. `layer` is the Mamba
    layer's ordinal (0 for the first Mamba layer), not its index in the whole stack.
    """

    def __init__(
        self,
        specs: list[list[tuple[str, tuple[int, ...]]]],
        num_slots: int,
        dtype=None,
        device="cpu",
        wrap_bits: int | None = None,
        part_dtypes: dict | None = None,
        null_slot: bool = False,
    ):
        import torch

        # speculative decoding: one scratch slot past the pool (vLLM's null block / PAD slot), where the
        # verify path's state index points for a request without a state table; the pool never hands it out
        self.null_slot = num_slots if null_slot else None
        num_slots += bool(null_slot)
        self.num_slots = num_slots
        self.specs = specs
        self.offsets: list[dict[str, int]] = []
        self.shapes: list[dict[str, tuple[int, ...]]] = []
        off = 0
        for parts in specs:
            self.offsets.append({})
            self.shapes.append({})
            for name, shape in parts:
                self.offsets[-1][name] = off
                self.shapes[-1][name] = tuple(shape)
                off += prod(shape)
        self.slot_stride = off  # elements per slot
        self.wrap_bits = wrap_bits
        self.buffer = torch.zeros(num_slots * self.slot_stride, dtype=dtype or torch.float32, device=device)
        self._round = {name: d for name, d in (part_dtypes or {}).items() if d is not None and d != self.buffer.dtype}
        self._torch = torch

    @property
    def slot_bytes(self) -> int:
        return self.slot_stride * self.buffer.element_size()

    def base(self, slot: int, path: str) -> int:
        """Element offset of a slot's state. The prefill path wraps under the offset-wrap drill."""
        base = slot * self.slot_stride
        if path == "prefill" and self.wrap_bits is not None:
            base %= 1 << self.wrap_bits
        return base

    def wraps(self, slot: int) -> bool:
        return self.wrap_bits is not None and slot * self.slot_stride >= (1 << self.wrap_bits)

    def stray_write(self, slot: int, path: str) -> tuple[int, int, list[int]] | None:
        """Where a write of `slot`'s state on `path` lands when that is not the slot's own memory:
        (first element, end element, the slots that range overlaps), else None. The write log the
        trace keeps (`stray_writes`) and the offset-wrap drill's ground truth both come from it."""
        start = self.base(slot, path)
        if start == slot * self.slot_stride:
            return None
        end = start + self.slot_stride
        return start, end, list(range(start // self.slot_stride, (end - 1) // self.slot_stride + 1))

    def _exact(self, slots: list[int], path: str) -> bool:
        return path == "decode" or self.wrap_bits is None or not any(self.wraps(s) for s in slots)

    def _index(self, layer: int, name: str, slots: list[int], path: str):
        """Element indices of a part for wrapped offsets (the only case a 2-D view cannot express)."""
        torch = self._torch
        size = prod(self.shapes[layer][name])
        bases = torch.tensor([self.base(s, path) + self.offsets[layer][name] for s in slots], dtype=torch.long)
        return (bases.unsqueeze(1) + torch.arange(size, dtype=torch.long).unsqueeze(0)).to(self.buffer.device)

    def _part(self, layer: int, name: str):
        """The part's columns of every slot: a [num_slots, size] view of the buffer (exact offsets)."""
        off = self.offsets[layer][name]
        return self.buffer.view(self.num_slots, self.slot_stride)[:, off : off + prod(self.shapes[layer][name])]

    def slot_index(self, slots: list[int]):
        """`slots` as the index tensor `read` and `write` take (build it once for several parts)."""
        return self._torch.tensor(slots, dtype=self._torch.long, device=self.buffer.device)

    def read(self, layer: int, name: str, slots: list[int], path: str, index=None):
        """A copy of the state of `slots`: [len(slots), *shape]. `index`: `slot_index(slots)`, if built."""
        shape = (len(slots), *self.shapes[layer][name])
        if self._exact(slots, path):  # exact offsets: slot * slot_stride + part offset, as a 2-D view
            index = self.slot_index(slots) if index is None else index
            return self._part(layer, name).index_select(0, index).view(shape)
        return self.buffer[self._index(layer, name, slots, path)].view(shape)

    def write(self, layer: int, name: str, slots: list[int], values, path: str, index=None) -> None:
        if name in self._round:
            values = values.to(self._round[name])
        values = values.to(self.buffer.dtype)
        if self._exact(slots, path):
            index = self.slot_index(slots) if index is None else index
            self._part(layer, name).index_copy_(0, index, values.reshape(len(slots), -1))
            return
        self.buffer[self._index(layer, name, slots, path).view(-1)] = values.reshape(-1)

    def zero(self, slot: int) -> None:
        start = slot * self.slot_stride
        self.buffer[start : start + self.slot_stride] = 0
