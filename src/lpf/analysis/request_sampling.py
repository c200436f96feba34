"""Each request's own sampling settings, as the judgement of its tokens needs them.

A run lpf drives samples every request alike (the manifest's sampling); real traffic (`lpf watch`) does not:
a temperature-0.8 request's rank-2 token is a draw, not a greedy flip. The requests table's `sampling`
column (`schema.SAMPLING`, null: the run's) says what each client sent.

Contract (pure):
  `settings(requests, run_temperature) -> Settings | None`: None when no request says anything the run's
      settings do not (the analysis then runs as it always has: one greedy flag, one temperature).
      Otherwise per request (by id) its temperature: the one it sent; NaN when it sent none (the server's
      default, unknown: never greedy).
  `Settings.rows(request_ids, starts, n) -> (greedy, temperature)`: per scored row (the rows of request i
      are starts[i]..starts[i+1]), a bool and a float64 array, as `scoring` and `metrics` take them.
  `Settings.uniform -> float | None`: the one temperature every request sent (NaN counts as its own), else
      None: the run-level test's sampling sub-tests and the tempered-logprob signature need one.
  `Settings.greedy_ids -> list[str]`: the requests sent at temperature 0 (the penalty fit reads only them).
  MIXED_SAMPLING: the run-level test's sampling for a run of mixed settings: a temperature past 1 leaves only
      its temperature-free tests (logprobs, top-k), as `lpf watch`'s windows of mixed traffic have always been
      judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MIXED_TEMPERATURE = 2.0
MIXED_SAMPLING = {"temperature": MIXED_TEMPERATURE, "top_k": 0, "top_p": 1.0, "mixed": True}


@dataclass(frozen=True)
class Settings:
    ids: list[str]
    temperature: np.ndarray  # per request in `ids`; NaN: not sent

    @property
    def uniform(self) -> float | None:
        t = self.temperature
        if t.size == 0:
            return None
        if np.isnan(t).all():
            return float("nan")
        return float(t[0]) if (t == t[0]).all() else None

    @property
    def greedy_ids(self) -> list[str]:
        return [rid for rid, t in zip(self.ids, self.temperature.tolist()) if t == 0]

    def rows(self, request_ids, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = request_ids.to_pylist() if hasattr(request_ids, "to_pylist") else list(request_ids)
        at = {rid: i for i, rid in enumerate(self.ids)}
        per = np.array([self.temperature[at[r]] if r in at else np.nan for r in ids], dtype=np.float64)
        counts = np.diff(np.r_[np.asarray(starts, dtype=np.int64), n])
        temperature = np.repeat(per, counts)
        return temperature == 0, temperature


def settings(requests: pa.Table, run_temperature: float) -> Settings | None:
    if "sampling" not in requests.column_names:
        return None
    col = requests.column("sampling").combine_chunks()
    if col.null_count == len(col):
        return None
    given = pc.is_valid(col).to_numpy(zero_copy_only=False)
    sent = pc.struct_field(col, "temperature").to_numpy(zero_copy_only=False).astype(np.float64)
    # a request without its own settings samples as the run does; one whose client sent no temperature
    # got the server's default (NaN: unknown)
    temperature = np.where(given, sent, float(run_temperature))
    if (temperature == float(run_temperature)).all():
        return None
    return Settings(requests.column("request_id").to_pylist(), temperature)
