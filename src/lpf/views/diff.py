"""`lpf diff RUN_A RUN_B`: read two analysed run directories and say who departs (`analysis.diff`).

Contract: `diff_runs(a, b, level) -> (per-request table, document)`. Both directories must be
analysed runs (findings.json + summary.parquet) of the same workload (their tokenized workload.jsonl
is byte-identical), the same sampling (temperature, top-p, top-k, max tokens, seed, ignore_eos,
rollouts) and the same reference (weights sha256 and dtype; the spec may name the same weights two
ways): otherwise `LpfError` says which differs, because a per-request comparison of different
requests or different references means nothing. The document is the summary of `analysis.diff` plus what was compared (each side's run
directory, engine, version and verdict, the reference) and the requests that have a suspect, worst
first (at most `MAX_LISTED`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.analysis.diff import DiffSide, diff_tables
from lpf.core.errors import LpfError
from lpf.run.store import RunDir

MAX_LISTED = 200
SAME_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos")


def _open(path: Path) -> tuple[RunDir, dict]:
    run = RunDir.open(path)
    f = run.path / "findings.json"
    if not f.is_file() or not (run.path / "summary.parquet").is_file():
        raise LpfError(f"{path} is not analysed yet (no findings.json / summary.parquet): run `lpf analyze {path}`")
    try:
        return run, json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{f}: unreadable JSON ({e.msg})") from None


def _workload_sha(run: RunDir) -> str:
    p = run.path / "workload.jsonl"
    if not p.is_file():
        raise LpfError(f"{run.path} has no workload.jsonl: cannot tell which requests it ran")
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check_comparable(ra: RunDir, rb: RunDir) -> None:
    ma, mb = ra.manifest, rb.manifest
    if _workload_sha(ra) != _workload_sha(rb):
        raise LpfError(f"{ra.path} and {rb.path} ran different workloads: diff compares the same requests")
    sa, sb = ma.get("sampling") or {}, mb.get("sampling") or {}
    for key in SAME_SAMPLING:
        if sa.get(key) != sb.get(key):
            raise LpfError(
                f"the runs differ in sampling {key} ({sa.get(key)!r} vs {sb.get(key)!r}): "
                f"diff compares the same workload with the same seeds"
            )
    if (ma.get("workload") or {}).get("n") != (mb.get("workload") or {}).get("n"):
        raise LpfError("the runs differ in rollouts per prompt (--n)")
    ref_a, ref_b = ma.get("reference"), mb.get("reference")
    if not ref_a or not ref_b:
        raise LpfError(f"{(rb if ref_a else ra).path} has not been rescored")
    for key in ("weights_sha256", "dtype"):
        if ref_a.get(key) != ref_b.get(key):
            raise LpfError(
                f"the runs were rescored by different references ({ref_a.get('spec')} {ref_a.get('dtype')} "
                f"vs {ref_b.get('spec')} {ref_b.get('dtype')}, {key} differs): rescore both with one "
                f"(lpf rescore RUN --reference M --redo)"
            )


def side(run: RunDir, findings: dict, label: str) -> DiffSide:
    engine = run.manifest.get("engine") or {}
    prompt = run.read("prompt_tokens") if run.has("prompt_tokens") else None
    return DiffSide(
        name=f"{engine.get('name', '?')} [{label}]",
        summary=pq.read_table(run.path / "summary.parquet"),
        tokens=run.read("tokens", ["request_id", "position", "token_id", "engine_logprob"]),
        clean_abs_diff=float((findings.get("thresholds") or {}).get("clean_abs_diff", 1e-3)),
        prompt_tokens=prompt,
    )


def diff_runs(path_a: Path, path_b: Path, level: str = "divergent") -> tuple[pa.Table, dict]:
    (ra, fa), (rb, fb) = _open(Path(path_a)), _open(Path(path_b))
    check_comparable(ra, rb)
    label_a, label_b = ra.path.name, rb.path.name
    if label_a == label_b:
        label_a, label_b = str(ra.path), str(rb.path)
    table, summary = diff_tables(side(ra, fa, label_a), side(rb, fb, label_b), level)
    if not summary["n_requests"]:
        raise LpfError(f"{ra.path} and {rb.path} have no scored request in common")
    listed = table.filter(pc.not_equal(table.column("suspect"), "none"))
    listed = listed.sort_by([("max_abs_diff_b", "descending")]).slice(0, MAX_LISTED)

    def about(run: RunDir, f: dict) -> dict:
        e = run.manifest.get("engine") or {}
        return {
            "run_dir": str(run.path),
            "engine": e.get("name"),
            "version": e.get("version"),
            "verdict": f.get("verdict"),
            "model": (run.manifest.get("model") or {}).get("spec"),
        }

    ref = ra.manifest["reference"]
    doc = {
        "kind": "diff",
        **summary,
        "run_a": about(ra, fa),
        "run_b": about(rb, fb),
        "reference": {k: ref.get(k) for k in ("spec", "dtype", "weights_sha256", "implementation")},
        "requests": listed.to_pylist(),
    }
    return table, doc
