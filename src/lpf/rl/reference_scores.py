"""The third logprob column: the HF reference teacher-forced over a dump's responses (`lpf rl rescore`).

`score(dump, reference, dtype, token_budget, ...)` runs `lpf.pipeline.reference.Rescorer` over every response
(its prompt_token_ids as context, every response position scored, masked ones too, so one file serves
any metric) and returns the table `reference.parquet` holds: step, request_id, position, token_id,
reference_logprob, with the reference's description under the Parquet key metadata "lpf".
`write(out_dir, table)` writes it atomically into the RL directory; `attach(dump, out_dir)` reads it
back for `lpf rl analyze`, checking that it was made for this dump (same responses, same token at
every position), and fills `Dump.tok_reference`. Responses without a prompt cannot be given their
context: `score` refuses, naming how many and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.rl.dump import Dump

REFERENCE_FILE = "reference.parquet"
SCHEMA = pa.schema([("step", pa.int64()), ("request_id", pa.string()), ("position", pa.int32()),
                    ("token_id", pa.int64()), ("reference_logprob", pa.float64())])


def _noop(*_):
    pass


def score(dump: Dump, reference: str, dtype: str = "float32", token_budget: int = 16384,
          on_start: Callable = _noop, tick: Callable = _noop, device: str = "cpu") -> pa.Table:
    from lpf.core.model_specs import resolve_model
    from lpf.pipeline.reference import Rescorer, ScoreItem

    prompts = dump.sequences.column("prompt_token_ids").to_pylist()
    outputs = dump.sequences.column("response_token_ids").to_pylist()
    ids = dump.responses.column("request_id").to_pylist()
    none = [i for i, p in enumerate(prompts) if not p]
    if none:
        raise LpfError(f"{dump.source}: {len(none)} of {len(prompts)} responses carry no prompt token ids (first: "
                       f"{ids[none[0]]}), so the reference cannot be given their context; {_HOW.get(dump.fmt, '')}")
    if token_budget < 1:
        raise LpfError(f"--token-budget must be >= 1, got {token_budget}")
    rescorer = Rescorer(resolve_model(reference), dtype=dtype, device=device, token_budget=token_budget, topk=1)
    items = [ScoreItem(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    for it in items:
        rescorer.validate(it)  # every request checked before the bar starts: an error prints alone
    on_start(sum(len(o) for o in outputs), 0)
    parts = []
    for table in rescorer.score(items, tick):
        parts.append(table.select(["request_id", "position", "ref_logprob"]))
    got = pa.concat_tables(parts)
    idx = np.asarray(pc.cast(got.column("request_id"), pa.int64()))
    pos = got.column("position").to_numpy()
    steps = dump.responses.column("step").to_numpy()
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in outputs])])
    flat = np.concatenate([np.asarray(o, dtype=np.int64) for o in outputs])
    meta = {"reference": rescorer.describe(), "dump": dump.source, "format": dump.fmt, "n_responses": len(items)}
    table = pa.table({"step": pa.array(steps[idx], pa.int64()),
                      "request_id": pa.array(np.asarray(ids, dtype=object)[idx], pa.string()),
                      "position": pa.array(pos, pa.int32()), "token_id": pa.array(flat[offsets[idx] + pos], pa.int64()),
                      "reference_logprob": got.column("ref_logprob").cast(pa.float64())}, schema=SCHEMA)
    return table.replace_schema_metadata({"lpf": json.dumps(meta)})


_HOW = {"verl": "add prompts and attention_mask per sample to the dump",
        "lpf": "add a prompt_token_ids column"}


def write(out_dir: Path, table: pa.Table) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REFERENCE_FILE
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def attach(dump: Dump, out_dir: Path) -> bool:
    """Fill `dump.tok_reference` from out_dir/reference.parquet; False when there is none."""
    path = out_dir / REFERENCE_FILE
    if not path.is_file():
        return False
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises many types for a damaged file
        raise LpfError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); rerun lpf rl rescore") from None
    missing = [c for c in SCHEMA.names if c not in table.column_names]
    if missing:
        raise LpfError(f"{path}: not a reference file of lpf rl rescore (no {', '.join(missing)})")
    meta = json.loads((table.schema.metadata or {}).get(b"lpf", b"{}"))
    stale = f"{path} was made for another dump; rerun lpf rl rescore {dump.source} (or remove that file)"
    outputs = dump.sequences.column("response_token_ids").to_pylist()
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in outputs])]).astype(np.int64)
    where = {(s, r): i for i, (s, r) in enumerate(zip(dump.responses.column("step").to_pylist(),
                                                       dump.responses.column("request_id").to_pylist()))}
    key = pc.binary_join_element_wise(pc.cast(table.column("step"), pa.string()), table.column("request_id"), "\x1f")
    enc = pc.dictionary_encode(key).combine_chunks()
    lookup = np.array([where.get((int(k.split("\x1f", 1)[0]), k.split("\x1f", 1)[1]), -1)
                       for k in enc.dictionary.to_pylist()], dtype=np.int64)
    resp = lookup[np.asarray(enc.indices)] if len(table) else np.zeros(0, dtype=np.int64)
    pos = table.column("position").to_numpy().astype(np.int64)
    n_tok = np.diff(offsets)
    if (resp < 0).any() or ((pos < 0) | (pos >= n_tok[np.maximum(resp, 0)])).any():
        raise LpfError(stale)
    flat_ref = np.full(int(offsets[-1]), np.nan)
    flat_tok = np.full(int(offsets[-1]), -1, dtype=np.int64)
    at = offsets[resp] + pos
    flat_ref[at] = table.column("reference_logprob").to_numpy()
    flat_tok[at] = table.column("token_id").to_numpy()
    want = np.concatenate([np.asarray(o, dtype=np.int64) for o in outputs])
    scored = offsets[dump.tok_resp] + dump.tok_pos
    if not np.array_equal(flat_tok[scored], want[scored]):
        raise LpfError(stale + " (token ids differ)")
    ref = flat_ref[scored]
    if not np.isfinite(ref).all():
        raise LpfError(f"{path}: reference logprobs missing or not finite for {int((~np.isfinite(ref)).sum())} scored "
                       f"tokens; rerun lpf rl rescore")
    dump.tok_reference = ref
    dump.reference = {"file": str(path), **meta}
    return True
