"""Which earlier computations a built-in engine request's numbers depend on (pure Python, no torch).

A request's step reads two kinds of memory another computation may have written: its Mamba state (a
`stride`-element region of the state-slot buffer at some element offset, which a drill may wrap)
and its KV rows (one row per position, `block_table[p // block_size] * block_size + p % block_size`,
shared by every attention layer). `Node` describes one request in one step as the runner runs it:
whether it zeroes its slot first, where it reads and writes its state (None: it does not), which
positions it writes and reads in the KV cache. `Dependencies(steps)` indexes every write of a
schedule (`steps`: per step, its nodes in batch order); `closure(start)` is every node the `start`
nodes depend on, transitively (theirs included); `state_writers(node)` names the nodes whose writes
the node's state read saw (None in the list: part of what it read was zeroed or never written).

Order inside a step is the built-in engine's (`lpf.builtin.models.mamba_base`, `attention`): slots
are zeroed first; prefill/extend chunks run one at a time in batch order (each reads its state, then
writes it; writes its KV rows, then reads); then the decode batch reads every state before any
decode writes, and writes its KV rows before any decode reads. A write is visible to a read iff it
comes first in that order. Replaying only the steps of `closure(...)` therefore reproduces those
nodes exactly: whatever else runs in those steps writes nothing they read.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

_SLOT = 1 << 13  # batch positions per step in the time code (a step holds fewer requests than this)


@dataclass(frozen=True)
class Node:
    step: int
    request_id: str
    decode: bool
    zeroes_slot: int | None  # element offset of the slot zeroed before the step (None: not zeroed)
    state_read: int | None  # element offset of the state read (None: starts from zero)
    state_write: int | None  # element offset of the state written (None: no Mamba layers)
    kv_start: int  # first position computed (its KV rows are written)
    kv_end: int  # one past the last position computed (rows 0..kv_end-1 are read)
    block_table: tuple[int, ...] = field(default=(), compare=False, hash=False)

    @property
    def key(self) -> tuple[int, str]:
        return self.step, self.request_id


class Dependencies:
    def __init__(self, steps: list[list[Node]], stride: int, block_size: int):
        self.stride, self.block_size = stride, block_size
        self.nodes: dict[tuple[int, str], Node] = {}
        self.times: dict[tuple[int, str], tuple[int, int, int, int]] = {}  # state r/w, kv w/r
        self._cells: dict[int, list[tuple[int, int, tuple | None]]] = {}  # cell -> [(time, base, writer)]
        self._rows: dict[int, list[tuple[int, tuple]]] = {}  # kv row -> [(time, writer)]
        for nodes in steps:
            self._index(nodes)

    # -- the forward pass: every write, in order ----------------------------------------------------
    def _index(self, nodes: list[Node]) -> None:
        if not nodes:
            return
        step = nodes[0].step
        n_chunks = sum(1 for n in nodes if not n.decode)
        base = step * 2 * _SLOT
        for n in nodes:
            if n.zeroes_slot is not None:
                self._write_state(base, n.zeroes_slot, None)
        chunk = 0
        for n in nodes:
            idx = (n_chunks + 1) if n.decode else (chunk := chunk + 1)
            t = base + 2 * idx
            self.nodes[n.key] = n
            self.times[n.key] = (t, t + 1, t, t + 1)  # state read, state write, kv write, kv read
        for n in nodes:  # writes after the times are known (decodes' writes follow every read)
            t_read, t_write, t_kv, _ = self.times[n.key]
            if n.state_write is not None:
                self._write_state(t_write, n.state_write, n.key)
            for p in range(n.kv_start, n.kv_end):
                self._rows.setdefault(self._row(n, p), []).append((t_kv, n.key))

    def _row(self, n: Node, p: int) -> int:
        return n.block_table[p // self.block_size] * self.block_size + p % self.block_size

    def _write_state(self, t: int, offset: int, writer) -> None:
        for cell in {offset // self.stride, (offset + self.stride - 1) // self.stride}:
            self._cells.setdefault(cell, []).append((t, offset, writer))

    # -- questions ------------------------------------------------------------------------------------
    def state_writers(self, node: Node) -> list[tuple[int, str] | None]:
        """The writers whose values the node's state read saw, latest first (None: zeroed or never
        written); [] when the node reads no state."""
        if node.state_read is None:
            return []
        t_read = self.times[node.key][0]
        lo, hi = node.state_read, node.state_read + self.stride
        cands = []
        for cell in {lo // self.stride, (hi - 1) // self.stride}:
            cands += [w for w in self._cells.get(cell, []) if w[0] < t_read]
        uncovered, out = [(lo, hi)], []
        for _, base, writer in sorted(set(cands), key=lambda w: -w[0]):
            left = []
            hit = False
            for a, b in uncovered:
                c, d = max(a, base), min(b, base + self.stride)
                if c < d:
                    hit = True
                    left += [seg for seg in ((a, c), (d, b)) if seg[0] < seg[1]]
                else:
                    left.append((a, b))
            if hit and writer not in out:
                out.append(writer)
            uncovered = left
            if not uncovered:
                break
        if uncovered and None not in out:
            out.append(None)  # never written since the buffer was allocated: zeros
        return out

    def kv_writers(self, node: Node) -> set[tuple[int, str]]:
        t_read = self.times[node.key][3]
        out = set()
        for p in range(node.kv_end):
            writes = self._rows.get(self._row(node, p), [])
            i = bisect_left(writes, (t_read,)) - 1
            if i >= 0 and writes[i][1] != node.key:
                out.add(writes[i][1])
        return out

    def closure(self, start: list[tuple[int, str]]) -> set[tuple[int, str]]:
        needed, todo = set(start), list(start)
        while todo:
            node = self.nodes[todo.pop()]
            deps = {w for w in self.state_writers(node) if w is not None} | self.kv_writers(node)
            for key in deps - needed:
                needed.add(key)
                todo.append(key)
        return needed
