"""The third logprob column: the HF reference teacher-forced over a dump's responses (`lpf rl rescore`).

`score(dump, reference, dtype, token_budget, ..., sampling, lag)` runs `lpf.pipeline.reference.Rescorer` over
every response (its prompt_token_ids as context, every response position scored, masked ones too, so
one file serves any metric) and returns the table the RL directory holds: step, request_id, position,
token_id, reference_logprob, reference_sensitivity (`lpf.rl.row_stats`), and reference_log_kept_mass
when the rollout's sampling settings are known (`sampling` = {temperature, top_k, top_p}; null
otherwise), reference_top_cumprob (the cumulative probability of the reference's most likely tokens,
`lpf.rl.row_stats.TOP_CUM` of them: what infers an unrecorded top-p / top-k), with the reference's description, the sampling and the lag under the Parquet key
metadata "lpf". `reference` may be a template holding `{step}` (the policy's checkpoint at each step:
`ckpt/step_{step}`): the responses of step s are scored with the checkpoint of step s - lag (lag 0: the
trainer's own weights; lag 1: the step before, what a one-step-stale rollout was generated with). A
lag checkpoint that does not exist leaves its responses' scores null (counted in the metadata); a
lag-0 one is an error. Lag 0 goes to `reference.parquet`, lag k to `reference_lag{k}.parquet`
(`write`). `attach(dump, out_dir)` reads them back for `lpf rl analyze` / `explain`, checking that
they were made for this dump (same responses, same token at every position), and fills
`Dump.tok_reference`, `tok_sensitivity`, `tok_log_kept`, `tok_top_cum` and the lagged `tok_reference_lag` /
`tok_log_kept_lag`. Responses without a prompt cannot be given their context: `score` refuses,
naming how many and why.

`reference` takes what `lpf audit --reference` takes, but `self` (a dump has no server to ask: refused in one
line): a model or checkpoint template (transformers, above), a trusted deployment `http(s)://HOST:PORT/v1`
(`server.reference_model` its served name, `model` the local copy: its tokenizer; default the model the
dump names) or `vllm:MODEL` (`server.reference_option`: -R knobs). Those are built by the audit's own
construction (`lpf.pipeline.rescore.prompt_reference`) and score from prompt logprobs: the reference logprob
only (sensitivity, kept mass and the top cumulative probabilities need the whole distribution: null, which
`attach` reads as absent), one model for every step (no `{step}` template, no lags).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.rl.dump import Dump

REFERENCE_FILE = "reference.parquet"
SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("request_id", pa.string()),
        ("position", pa.int32()),
        ("token_id", pa.int64()),
        ("reference_logprob", pa.float64()),
        ("reference_sensitivity", pa.float64()),
        ("reference_log_kept_mass", pa.float64()),
        ("reference_top_cumprob", pa.list_(pa.float32())),
        ("reference_log_kept_grid", pa.list_(pa.float32())),
    ]
)
REQUIRED = ("step", "request_id", "position", "token_id", "reference_logprob")
MAX_LAG = 8
_LAG_FILE = re.compile(r"reference_lag(\d+)\.parquet$")


def _noop(*_):
    pass


def file_name(lag: int) -> str:
    return REFERENCE_FILE if lag == 0 else f"reference_lag{lag}.parquet"


def score(
    dump: Dump,
    reference: str,
    dtype: str = "float32",
    token_budget: int = 16384,
    on_start: Callable = _noop,
    tick: Callable = _noop,
    device: str = "cpu",
    sampling: dict | None = None,
    lag: int = 0,
    server=None,
    model: str | None = None,
) -> pa.Table:
    """The reference's scores of every response (module docstring); `server` an
    `lpf.pipeline.rescore.RescoreSettings` holding a server or vLLM reference's settings (its served name,
    concurrency and -R knobs), `model` the local copy of a served model."""
    prompts = dump.sequences.column("prompt_token_ids").to_pylist()
    outputs = dump.sequences.column("response_token_ids").to_pylist()
    ids = dump.responses.column("request_id").to_pylist()
    steps = dump.responses.column("step").to_numpy()
    none = [i for i, p in enumerate(prompts) if not p]
    if none:
        raise LpfError(
            f"{dump.source}: {len(none)} of {len(prompts)} responses carry no prompt token ids (first: "
            f"{ids[none[0]]}), so the reference cannot be given their context; {_HOW.get(dump.fmt, '')}"
        )
    if token_budget < 1:
        raise LpfError(f"--token-budget must be >= 1, got {token_budget}")
    if not 0 <= lag <= MAX_LAG:
        raise LpfError(f"--lags: each lag must be in 0..{MAX_LAG}, got {lag}")
    from lpf.pipeline.reference_http import reference_form

    if reference_form(reference) != "transformers":
        parts, describe = _by_server(reference, server, model, prompts, outputs, lag, on_start, tick)
        return _table(parts, describe, reference, dump, ids, steps, outputs, lag, sampling, 0, templated=False)
    if server is not None:  # -R or a served name beside a model: the audit's one-line refusals
        server.validate()
    if model is not None:
        raise LpfError("--model goes with --reference http(s)://... or vllm:MODEL (the local copy of a served model)")
    templated = "{step}" in reference
    if lag and not templated:
        raise LpfError(
            f"--lags {lag} needs a reference per step: give --reference as a template holding {{step}} "
            f"(the policy's checkpoints, e.g. ckpt/step_{{step}})"
        )
    from lpf.core.model_specs import resolve_model  # torch and transformers only once the request is sound
    from lpf.pipeline.reference import Rescorer, ScoreItem
    from lpf.rl.row_stats import RowStats

    groups = {}  # checkpoint spec -> response indices
    missing = 0
    for i, s in enumerate(steps):
        spec = reference.replace("{step}", str(int(s) - lag)) if templated else reference
        groups.setdefault(spec, []).append(i)
    resolved = {}
    for spec in groups:
        try:
            resolved[spec] = resolve_model(spec)
        except LpfError:
            if lag == 0 or not templated:
                raise
            resolved[spec] = None
    stats = RowStats(**sampling) if sampling else RowStats()
    on_start(sum(len(outputs[i]) for spec, idx in groups.items() if resolved[spec] is not None for i in idx), 0)
    parts, describe = [], None
    for spec, idx in groups.items():
        if resolved[spec] is None:
            missing += len(idx)
            continue
        rescorer = Rescorer(
            resolved[spec], dtype=dtype, device=device, token_budget=token_budget, topk=1, on_rows=stats
        )
        describe = describe or rescorer.describe()
        items = [ScoreItem(str(i), prompts[i], outputs[i]) for i in idx]
        for it in items:
            rescorer.validate(it)  # every request checked before its checkpoint scores: an error prints alone
        for table in rescorer.score(items, tick):
            kept, sens, cum, grid = stats.take()
            table = table.select(["request_id", "position", "ref_logprob"])
            parts.append(
                table.append_column("sens", pa.array(sens, pa.float64()))
                .append_column("kept", pa.array(kept if kept is not None else [None] * len(sens), pa.float64()))
                .append_column("cum", _lists(cum))
                .append_column("grid", _lists(grid))
            )
        del rescorer
    if not parts:
        raise LpfError(f"no checkpoint of {reference!r} at lag {lag} exists for any step of {dump.source}")
    return _table(parts, describe, reference, dump, ids, steps, outputs, lag, sampling, missing, templated)


def _by_server(reference, server, model, prompts, outputs, lag, on_start, tick) -> tuple[list, dict]:
    """(score parts, the reference's description) of a server or vLLM reference (module docstring)."""
    from lpf.core.model_specs import load_tokenizer, resolve_model, tokenizer_fingerprint
    from lpf.pipeline.reference import ScoreItem
    from lpf.pipeline.reference_http import reference_form
    from lpf.pipeline.rescore import RescoreSettings, prompt_reference

    form = reference_form(reference)
    if form == "self":
        raise LpfError(
            "--reference self re-scores on an audited server, and a dump has none: give the trainer's checkpoint, "
            "a trusted deployment http(s)://HOST:PORT/v1 or vllm:MODEL"
        )
    if lag:
        raise LpfError(f"--lags {lag}: a server or vLLM reference serves one model; lags need checkpoints per step")
    settings = RescoreSettings(reference=reference) if server is None else server
    settings.validate()
    if model is None and form == "vllm":
        from lpf.pipeline.reference_vllm import parse_spec

        model = parse_spec(reference)
    if model is None:
        raise LpfError(
            f"--reference {reference} needs --model (the local copy of the served model: its tokenizer); "
            f"this dump does not name its model"
        )
    local = resolve_model(model)
    manifest = {"model": {"spec": model}, "tokenizer_sha256": tokenizer_fingerprint(load_tokenizer(local))}
    rescorer = prompt_reference(manifest, reference, settings, topk=1)
    items = [ScoreItem(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs)) if o]
    on_start(sum(len(o) for o in outputs), 0)
    parts = []
    for table in rescorer.score(items, tick):
        n = table.num_rows
        parts.append(
            table.select(["request_id", "position", "ref_logprob"])
            .append_column("sens", pa.nulls(n, pa.float64()))
            .append_column("kept", pa.nulls(n, pa.float64()))
            .append_column("cum", pa.nulls(n, pa.list_(pa.float32())))
            .append_column("grid", pa.nulls(n, pa.list_(pa.float32())))
        )
    if not parts:
        raise LpfError(f"{reference} scored no response (every response is empty)")
    return parts, rescorer.describe()


def _table(parts, describe, reference, dump, ids, steps, outputs, lag, sampling, missing, templated) -> pa.Table:
    """The RL directory's reference table (SCHEMA, the metadata under "lpf") from the scored parts."""
    from lpf.rl.row_stats import P_GRID

    got = pa.concat_tables(parts)
    idx = np.asarray(pc.cast(got.column("request_id"), pa.int64()))
    pos = got.column("position").to_numpy()
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in outputs])])
    flat = np.concatenate([np.asarray(o, dtype=np.int64) for o in outputs])
    meta = {
        "reference": describe,
        "template": reference if templated else None,
        "dump": dump.source,
        "format": dump.fmt,
        "n_responses": len(ids),
        "lag": lag,
        "sampling": sampling,
        "n_responses_without_checkpoint": missing,
        "top_p_grid": list(P_GRID),
    }
    table = pa.table(
        {
            "step": pa.array(steps[idx], pa.int64()),
            "request_id": pa.array(np.asarray(ids, dtype=object)[idx], pa.string()),
            "position": pa.array(pos, pa.int32()),
            "token_id": pa.array(flat[offsets[idx] + pos], pa.int64()),
            "reference_logprob": got.column("ref_logprob").cast(pa.float64()),
            "reference_sensitivity": got.column("sens"),
            "reference_log_kept_mass": got.column("kept"),
            "reference_top_cumprob": got.column("cum"),
            "reference_log_kept_grid": got.column("grid"),
        },
        schema=SCHEMA,
    )
    return table.replace_schema_metadata({"lpf": json.dumps(meta)})


def _lists(a: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), pa.float32()), a.shape[1]).cast(
        pa.list_(pa.float32())
    )


_HOW = {"verl": "add prompts and attention_mask per sample to the dump", "lpf": "add a prompt_token_ids column"}


def write(out_dir: Path, table: pa.Table, lag: int = 0) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(lag)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def attach(dump: Dump, out_dir: Path) -> bool:
    """Fill the dump's reference arrays from out_dir/reference.parquet (and reference_lag{k}.parquet);
    False when there is no reference.parquet."""
    path = out_dir / REFERENCE_FILE
    if not path.is_file():
        return False
    ref, sens, kept, meta = _read(dump, path, lagged=False)
    dump.tok_reference, dump.tok_sensitivity, dump.tok_log_kept = ref, sens, kept
    dump.tok_top_cum = _list_column(dump, path, "reference_top_cumprob")
    grid = _list_column(dump, path, "reference_log_kept_grid")
    dump.tok_kept_grid = None if grid is None else (tuple(meta.get("top_p_grid") or ()), grid)
    dump.reference = {"file": str(path), **meta}
    for f in sorted(out_dir.glob("reference_lag*.parquet")):
        m = _LAG_FILE.search(f.name)
        if not m or not 1 <= int(m.group(1)) <= MAX_LAG:
            continue
        k = int(m.group(1))
        dump.tok_reference_lag[k], _, dump.tok_log_kept_lag[k], lag_meta = _read(dump, f, lagged=True)
        dump.reference.setdefault("lags", {})[k] = {
            "file": str(f),
            "template": lag_meta.get("template"),
            "n_responses_without_checkpoint": lag_meta.get("n_responses_without_checkpoint", 0),
        }
    return True


def _token_layout(dump: Dump) -> tuple[list, np.ndarray, dict]:
    """(each sequence's response token ids, the offset of each response's first token in the flat token
    order, {(step, request_id): response index}): where a reference file's rows land among the dump's tokens."""
    outputs = dump.sequences.column("response_token_ids").to_pylist()
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in outputs])]).astype(np.int64)
    where = {
        (s, r): i
        for i, (s, r) in enumerate(
            zip(dump.responses.column("step").to_pylist(), dump.responses.column("request_id").to_pylist())
        )
    }
    return outputs, offsets, where


def _list_column(dump: Dump, path: Path, name: str) -> np.ndarray | None:
    """[scored tokens, width] of a list column (the cumulative top probabilities, the kept mass per top-p;
    NaN where absent), or None for a file made before lpf stored it. Rows line up with `_read`'s (checked
    there)."""
    table = (
        pq.read_table(path, columns=["step", "request_id", "position", name])
        if name in pq.read_schema(path).names
        else None
    )
    if table is None:
        return None
    col = table.column(name).combine_chunks()
    if col.null_count == len(col):
        return None
    width = int(np.max(pc.list_value_length(col).to_numpy(zero_copy_only=False)))
    _, offsets, where = _token_layout(dump)
    resp = np.array(
        [where[(s, r)] for s, r in zip(table.column("step").to_pylist(), table.column("request_id").to_pylist())],
        dtype=np.int64,
    )
    at = offsets[resp] + table.column("position").to_numpy().astype(np.int64)
    flat = np.full((int(offsets[-1]), width), np.nan, dtype=np.float32)
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    full = lengths == width
    if full.all():
        flat[at] = values.reshape(-1, width)
    else:  # a row cut short (vocabulary under TOP_CUM tokens cannot happen per file; kept general)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for j in np.flatnonzero(lengths > 0):
            flat[at[j], : lengths[j]] = values[starts[j] : starts[j] + lengths[j]]
    return flat[offsets[dump.tok_resp] + dump.tok_pos]


def _read(dump: Dump, path: Path, lagged: bool):
    """(reference logprob, sensitivity or None, log kept mass or None, metadata) per scored token."""
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises many types for a damaged file
        raise LpfError(
            f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); rerun lpf rl rescore"
        ) from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise LpfError(f"{path}: not a reference file of lpf rl rescore (no {', '.join(missing)})")
    meta = json.loads((table.schema.metadata or {}).get(b"lpf", b"{}"))
    stale = f"{path} was made for another dump; rerun lpf rl rescore {dump.source} (or remove that file)"
    outputs, offsets, where = _token_layout(dump)
    key = pc.binary_join_element_wise(pc.cast(table.column("step"), pa.string()), table.column("request_id"), "\x1f")
    enc = pc.dictionary_encode(key).combine_chunks()
    lookup = np.array(
        [where.get((int(k.split("\x1f", 1)[0]), k.split("\x1f", 1)[1]), -1) for k in enc.dictionary.to_pylist()],
        dtype=np.int64,
    )
    resp = lookup[np.asarray(enc.indices)] if len(table) else np.zeros(0, dtype=np.int64)
    pos = table.column("position").to_numpy().astype(np.int64)
    n_tok = np.diff(offsets)
    if (resp < 0).any() or ((pos < 0) | (pos >= n_tok[np.maximum(resp, 0)])).any():
        raise LpfError(stale)
    at = offsets[resp] + pos
    flat_tok = np.full(int(offsets[-1]), -1, dtype=np.int64)
    flat_tok[at] = table.column("token_id").to_numpy()
    want = np.concatenate([np.asarray(o, dtype=np.int64) for o in outputs])
    scored = offsets[dump.tok_resp] + dump.tok_pos
    present = flat_tok[scored] >= 0
    if (not lagged and not present.all()) or not np.array_equal(flat_tok[scored][present], want[scored][present]):
        raise LpfError(stale + " (token ids differ)")

    def column(name):
        if name not in table.column_names or table.column(name).null_count == len(table):
            return None
        flat = np.full(int(offsets[-1]), np.nan)
        flat[at] = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        return flat[scored]

    ref = column("reference_logprob")
    if ref is None:
        ref = np.full(scored.size, np.nan)
    if not lagged and not np.isfinite(ref).all():
        raise LpfError(
            f"{path}: reference logprobs missing or not finite for {int((~np.isfinite(ref)).sum())} scored "
            f"tokens; rerun lpf rl rescore"
        )
    return ref, column("reference_sensitivity"), column("reference_log_kept_mass"), meta
