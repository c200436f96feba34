"""Zeller's delta debugging (ddmin), generic: the smallest subset of items that still fails a test.

Contract: `ddmin(items, test) -> list` where `test(subset) -> bool` says whether a subset (a list
in the items' own order) still shows the failure, and `test(items)` is assumed true (the caller
checked it). The result is 1-minimal with respect to `test`: removing any single item from it makes
`test` false (for the subsets the algorithm tried; ddmin assumes nothing about monotonicity and
proves nothing beyond the tests it ran). Each subset is tested at most once (outcomes are cached by
the items' positions), so a test that is expensive is never repeated; an exception raised by
`test` (a spent budget) propagates, and `on_reduce(subset)` has been called with every subset that
was adopted, so the caller always holds the smallest failing subset found so far.

The algorithm (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", 2002):
split the current set into n chunks; if a chunk alone fails, continue with it (n = 2); else if the
complement of a chunk fails, continue with that complement (n = max(n - 1, 2)); else double n, up
to one item per chunk; stop when a single-item granularity finds nothing. A one-item set is tried
empty once, so an empty result means the failure needs none of the items.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def split(n_items: int, n: int) -> list[range]:
    """`n` contiguous chunks of positions 0..n_items-1, sizes differing by at most one."""
    n = max(1, min(n, n_items))
    bounds = [round(i * n_items / n) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def ddmin(
    items: Sequence[T], test: Callable[[list[T]], bool], on_reduce: Callable[[list[T]], None] = lambda subset: None
) -> list[T]:
    items = list(items)
    seen: dict[tuple[int, ...], bool] = {tuple(range(len(items))): True}

    def fails(positions: list[int]) -> bool:
        key = tuple(positions)
        if key not in seen:
            seen[key] = bool(test([items[i] for i in positions]))
        return seen[key]

    current, n = list(range(len(items))), 2
    while len(current) >= 2:
        chunks = [[current[i] for i in r] for r in split(len(current), n)]
        reduced = next((c for c in chunks if fails(c)), None)
        if reduced is not None:
            current, n = reduced, 2
            on_reduce([items[i] for i in current])
            continue
        if len(chunks) > 2:  # with two chunks each complement is the other chunk, already tested
            complements = ([i for i in current if i not in set(c)] for c in chunks)
            reduced = next((comp for comp in complements if fails(comp)), None)
            if reduced is not None:
                current, n = reduced, max(n - 1, 2)
                on_reduce([items[i] for i in current])
                continue
        if n >= len(current):
            break
        n = min(2 * n, len(current))
    if len(current) == 1 and fails([]):
        current = []
        on_reduce([])
    return [items[i] for i in current]
