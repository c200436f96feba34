"""The progress callbacks every stage takes: `on_start(total, done)` once its inputs are validated (so
an error prints alone), then `tick(n)` as work completes. The defaults do nothing."""

from typing import Callable

OnStart = Callable[[int, int], None]
Tick = Callable[[int], None]


def no_start(total: int, done: int) -> None:
    pass


def no_tick(n: int) -> None:
    pass
