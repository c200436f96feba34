"""What a test hands `lpf.compare`: one record per request, read into `Output`s or refused in one line.

Accepted (`read_outputs(outputs)`):
- a sequence of mappings (or objects with these attributes), one per request: `prompt_token_ids`,
  `output_token_ids` (or `token_ids`), `logprobs`, and optionally `request_id`, `topk_ids` + `topk_logprobs`,
  `finish_reason`, `prompt_id`. `logprobs` is one float per output token, or vLLM's shape: one
  {token id: logprob (or an object with `.logprob`)} dict per token, holding the sampled token (its
  logprob) and the top-k (ids and logprobs, in descending order); JSON's string keys are read as ids.
- a pyarrow Table with those columns, or a mapping of column name -> list (one entry per request).
Lists, tuples and numpy arrays are all read as lists. Request ids default to `r00000`, `r00001`, ... in
order; the order is the arrival order lpf records (`seq`). Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from lpf.core.errors import LpfError


@dataclass(frozen=True)
class Output:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_id: str | None = None


def _get(rec: Any, *names: str):
    for n in names:
        if isinstance(rec, Mapping):
            if n in rec:
                return rec[n]
        elif hasattr(rec, n):
            return getattr(rec, n)
    return None


def _ints(value, what: str) -> list[int]:
    try:
        return [int(x) for x in _plain(value)]
    except (TypeError, ValueError):
        raise LpfError(f"{what}: expected a list of token ids") from None


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _rows(outputs) -> list:
    if hasattr(outputs, "to_pylist") and hasattr(outputs, "column_names"):  # a pyarrow Table
        return outputs.to_pylist()
    if isinstance(outputs, Mapping):  # columns
        cols = {k: _plain(v) for k, v in outputs.items()}
        lengths = {len(v) for v in cols.values()}
        if len(lengths) > 1:
            raise LpfError(
                f"outputs: columns of different lengths ({', '.join(f'{k}: {len(v)}' for k, v in cols.items())})"
            )
        n = lengths.pop() if lengths else 0
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        try:
            return list(outputs)
        except TypeError:
            raise LpfError(
                f"outputs: expected a list of per-request records, a pyarrow Table or a dict of columns, "
                f"got {type(outputs).__name__}"
            ) from None
    return list(outputs)


def _token_logprobs(raw, output_ids: list[int], where: str) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """(logprob per token, top-k ids, top-k logprobs) from floats or vLLM's per-token dicts."""
    items = _plain(raw)
    if len(items) != len(output_ids):
        raise LpfError(f"{where}: {len(items)} logprobs for {len(output_ids)} output tokens")
    if not items or not isinstance(items[0], Mapping):
        try:
            lps = [float(x) for x in items]
        except (TypeError, ValueError):
            raise LpfError(f"{where}: logprobs must be numbers, or one {{token id: logprob}} dict per token") from None
        return lps, [], []
    lps, ids, vals = [], [], []
    for i, (d, tok) in enumerate(zip(items, output_ids)):
        if not isinstance(d, Mapping):
            raise LpfError(f"{where}: logprobs[{i}] is not a {{token id: logprob}} dict like the others")
        entry = {int(k): float(getattr(v, "logprob", v)) for k, v in d.items()}
        if tok not in entry:
            raise LpfError(f"{where}: logprobs[{i}] has no entry for the sampled token {tok}")
        lps.append(entry[tok])
        ranked = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))
        ids.append([k for k, _ in ranked])
        vals.append([v for _, v in ranked])
    return lps, ids, vals


def read_outputs(outputs) -> list[Output]:
    rows = _rows(outputs)
    if not rows:
        raise LpfError("outputs: no requests to compare")
    seen: set[str] = set()
    out = []
    for i, rec in enumerate(rows):
        rid = _get(rec, "request_id")
        rid = f"r{i:05d}" if rid is None else str(rid)
        where = f"outputs[{i}] ({rid})"
        if rid in seen:
            raise LpfError(f"{where}: request id {rid!r} given twice")
        seen.add(rid)
        prompt, output, raw = (
            _get(rec, "prompt_token_ids"),
            _get(rec, "output_token_ids", "token_ids"),
            _get(rec, "logprobs"),
        )
        for name, value in (("prompt_token_ids", prompt), ("output_token_ids", output), ("logprobs", raw)):
            if value is None:
                raise LpfError(f"{where}: no {name}")
        prompt, output = _ints(prompt, f"{where} prompt_token_ids"), _ints(output, f"{where} output_token_ids")
        if not prompt:
            raise LpfError(f"{where}: an empty prompt (the reference needs at least one token before the output)")
        lps, tk_ids, tk_lps = _token_logprobs(raw, output, where)
        if any(math.isnan(x) for x in lps):
            raise LpfError(f"{where}: a NaN logprob")
        given_ids, given_lps = _get(rec, "topk_ids"), _get(rec, "topk_logprobs")
        if given_ids is not None or given_lps is not None:
            if given_ids is None or given_lps is None:
                raise LpfError(f"{where}: topk_ids and topk_logprobs go together")
            tk_ids = [_ints(x, f"{where} topk_ids") for x in _plain(given_ids)]
            tk_lps = [[float(v) for v in _plain(x)] for x in _plain(given_lps)]
            if len(tk_ids) != len(output) or len(tk_lps) != len(output):
                raise LpfError(f"{where}: top-k lists for {len(tk_ids)} positions, {len(output)} output tokens")
        out.append(
            Output(
                rid,
                prompt,
                output,
                lps,
                tk_ids,
                tk_lps,
                str(_get(rec, "finish_reason") or "length"),
                None if _get(rec, "prompt_id") is None else str(_get(rec, "prompt_id")),
            )
        )
    return out
