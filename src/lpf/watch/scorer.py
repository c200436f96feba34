"""The scoring process: rescore what the proxy recorded, judge full windows, append them to `live/windows.jsonl`.

Contract: `python -m lpf.watch.scorer RUN --spec FILE|-` runs until killed, with the settings of a
`lpf.watch.spec.ScorerSpec` read from FILE (JSON; `-`: stdin), as `lpf audit --spec` reads an AuditSpec
(reference, dtype, device, window N, poll, max_lag, token budget, executor local|ray and its Ray options). Each cycle:
every committed, not-yet-scored request is teacher-forced by one `Rescorer` kept loaded (or, with
`--executor ray`, by K Ray actors each holding one: `lpf.watch.ray_scoring`; the same rows) (`reference/` parts, as `lpf rescore` writes them: resumable, so a scorer
killed mid-batch and restarted redoes nothing committed), then every complete window is judged
(`windows.judge_window`) and appended as one JSON line to `live/windows.jsonl` (flushed and fsynced
before the next). Bounded lag: at most `per_cycle` requests are scored between two judgements, and when more
than `--max-lag` recorded requests wait, the oldest are given up (listed in `live/skipped.txt`, counted,
still recorded: `lpf rescore` can score them later) so the scorer stays on recent traffic. A window is the next N scored (or failed) requests in arrival order that no earlier
window holds; a request committed after a later window was judged joins the next window. A failed sample
(`error` set) and one nothing can be scored from (`lpf.watch.outages.unscored_reason`: stripped logprobs,
re-encoded text, no output) settle at once, unscored: they are facts of their window (`n_failed`, `failed`
by status class, `unscored` by reason, `upstream_failing`, `result`), never scoring lag. Each window line
also has its full extent (`first_seq`..`last_seq`, `t_first`..`t_last` arrival times, failed requests
included) and, when alarmed, its incident (`lpf.watch.incidents`: one change point per incident). Progress
(`scored`, `recorded`, the newest scored request's arrival, `pending` answered samples not yet scored and
the oldest one's arrival, `failed` by class, `unscored` by reason) goes to `live/scorer.json` for /metrics.
Parts that `--retain` deleted are forgotten (a part
gone between its listing and its reading is skipped), so their requests are no longer judged. It never opens
the run with `RunDir.open` (which deletes a tokens part whose requests part is not yet
written: the recorder may be between the two).
"""

from __future__ import annotations

import json
from contextlib import suppress
import os
import signal
import sys
import time
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.pipeline.reference_http import reference_form
from lpf.run.store import RunDir, read_part
from lpf.watch.incidents import Incidents
from lpf.watch.outages import failure_class, leaves_scoring, unscored_reason, window_facts, window_result

WINDOWS = "live/windows.jsonl"
STATUS = "live/scorer.json"
SKIPPED = "live/skipped.txt"
REQ_COLS = ["request_id", "seq", "prompt_token_ids", "output_token_ids", "error", "inconsistency", "t_submit"]
WATCH_COLS = ["request_id", "temperature", "stream", "status", "model"]


def _open(path: Path) -> RunDir:
    return RunDir(path, json.loads((path / "manifest.json").read_text()))


class Scorer:
    def __init__(
        self,
        path: Path,
        reference: str,
        dtype: str,
        device: str,
        window: int,
        token_budget: int = 16384,
        max_lag: int = 10_000,
        per_cycle: int = 512,
        executor: str = "local",
        ray=None,
        reference_model: str | None = None,
        reference_concurrency: int | None = None,
    ):
        from lpf.core.model_specs import resolve_model
        from lpf.pipeline.analyze import floor_table
        from lpf.pipeline.calibrate import engine_dtype
        from lpf.pipeline.reference import Rescorer
        from lpf.watch.windows import incident_change

        self.path, self.window, self.max_lag, self.per_cycle = path, window, max_lag, per_cycle
        self.kind = reference_form(reference)
        run = _open(path)
        topk = run.manifest["sampling"].get("logprobs", 5)
        kind = self.kind
        if kind != "transformers":  # the upstream itself, or a trusted deployment: prompt logprobs over HTTP
            from lpf.pipeline.reference_http import for_run

            self.rescorer = for_run(run.manifest, reference, reference_model, reference_concurrency, topk)
            self.model = self.rescorer.model
        elif executor == "ray":  # actors on a Ray cluster, each holding the reference (lpf.watch.ray_scoring)
            from lpf.pipeline.rescore import RayOptions
            from lpf.watch.ray_scoring import RayRescorer

            self.model = resolve_model(reference)
            self.rescorer = RayRescorer(self.model, dtype, device, token_budget, topk, ray or RayOptions())
        else:
            self.model = resolve_model(reference)
            self.rescorer = Rescorer(self.model, dtype=dtype, device=device, token_budget=token_budget, topk=topk)
        if kind != "transformers":  # its work so far (a restarted scorer carries it on)
            with suppress(OSError, ValueError, KeyError, TypeError):
                before = json.loads((path / STATUS).read_text())["reference_cost"]
                self.rescorer.cost.update({k: before[k] for k in self.rescorer.cost})
        desc = self.rescorer.describe()
        # a server reference reads the run's own token ids (its tokenizer is the run's model's)
        if kind == "transformers" and desc["tokenizer_sha256"] != run.manifest["tokenizer_sha256"]:
            self.close()
            raise SystemExit(f"reference {reference} uses another tokenizer than the recorded run")
        run.manifest["reference"] = {**desc, "executor": executor}
        run.save_manifest()
        self.info = {
            "engine_dtype": engine_dtype(run.manifest),
            # a server reference's dtype is its own, not stated: the floor is the engine against it
            "reference_dtype": dtype if kind == "transformers" else None,
            "reference_kind": kind,
            "model": reference if kind == "transformers" else run.manifest["model"]["spec"],
            "floor_table": floor_table(),
        }
        self.requests: dict[str, pa.Table] = {}  # part name -> its requests
        self.watch: dict[str, pa.Table] = {}  # part name -> its watch rows (WATCH_COLS)
        self.scored: set[str] = set(run.read("reference", ["request_id"]).column("request_id").to_pylist())
        self.judged: set[str] = set()
        self.part_ids: dict[tuple[str, str], set[str]] = {}  # (table, part name) -> its request ids
        self.skipped: set[str] = set(_read_ids(path / SKIPPED))
        self.windows = 0
        self.context = None
        self.incidents = Incidents(lambda req, tok, ref, flagged: incident_change(req, tok, ref, flagged, self.info))
        lines = self._lines()
        for line in lines:
            self.judged.update(line["request_ids"])
            self.windows = max(self.windows, line["window"] + 1)
        self.incidents.restore(lines)

    def close(self) -> None:
        """Stop the Ray actors (and a local Ray this scorer started); nothing to do for a local reference."""
        if hasattr(self.rescorer, "close"):
            self.rescorer.close()

    def _score(self, items: list, served: dict):
        """The reference's scores of `items`; a self-reference asks the upstream for each request under the
        name its client sent (one upstream may serve several names)."""
        if self.kind != "self":
            yield from self.rescorer.score_all(items)
            return
        default = self.rescorer.served
        groups: dict[str, list] = {}
        for item in items:
            groups.setdefault(served.get(item.request_id) or default, []).append(item)
        for name, group in groups.items():
            self.rescorer.served = name
            try:
                yield from self.rescorer.score_all(group)
            except LpfError as e:  # what the upstream could not score is given up, not asked again each cycle
                print(f"lpf watch scorer: {e}", file=sys.stderr, flush=True)
                self._give_up([i.request_id for i in group if i.request_id not in self.scored])

    def _give_up(self, ids: list[str]) -> None:
        """Leave these recorded requests unscored for good (`live/skipped.txt`: `lpf rescore` can score them)."""
        with open(self.path / SKIPPED, "a") as f:
            f.write("".join(r + "\n" for r in ids))
            f.flush()
            os.fsync(f.fileno())
        self.skipped.update(ids)

    def _lines(self) -> list[dict]:
        p = self.path / WINDOWS
        if not p.is_file():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill: the window is judged again
                pass
        return out

    def _refresh(self, run: RunDir) -> pa.Table:
        for table, cache, read in (
            ("requests", self.requests, lambda p: read_part(p, "requests", REQ_COLS)),
            ("watch", self.watch, lambda p: pq.read_table(p, columns=WATCH_COLS)),
        ):
            names = set()
            for p in run.parts(table):
                names.add(p.name)
                if p.name not in cache:
                    got = _unless_pruned(p, read)
                    if got is not None:
                        cache[p.name] = got
            for gone in set(cache) - names:  # deleted by --retain: its requests are no longer recorded
                del cache[gone]
        return pa.concat_tables(list(self.requests.values())) if self.requests else None

    def cycle(self) -> int:
        """Score and judge what is ready; the number of windows judged."""
        from lpf.core.sampling import request_seed
        from lpf.pipeline.reference import ScoreItem

        run = _open(self.path)

        reqs = self._refresh(run)
        if reqs is None:
            return 0
        n_out = pc.list_value_length(reqs.column("output_token_ids")).fill_null(0).to_pylist()
        ids, errors = reqs.column("request_id").to_pylist(), reqs.column("error").to_pylist()
        stream, status, served = {}, {}, {}
        for t in self.watch.values():
            rids = t.column("request_id").to_pylist()
            stream.update(zip(rids, t.column("stream").to_pylist()))
            status.update(zip(rids, t.column("status").to_pylist()))
            served.update(zip(rids, t.column("model").to_pylist()))
        incons = reqs.column("inconsistency").to_pylist()
        classes = {r: failure_class(e, status.get(r)) for r, e in zip(ids, errors)}
        reasons = {r: unscored_reason(e, n, i, stream.get(r)) for r, e, n, i in zip(ids, errors, n_out, incons)}
        # a failed sample (upstream error) or one nothing can be scored from settles unscored: never a lag
        unscorable = {r for r, e in zip(ids, errors) if e is not None or leaves_scoring(reasons[r])}
        todo = [i for i, r in enumerate(ids) if r not in unscorable and r not in self.scored and r not in self.skipped]
        seqs = reqs.column("seq").to_pylist()
        todo.sort(key=lambda i: seqs[i])
        if len(todo) > self.max_lag:  # bounded lag: the oldest backlog is given up (kept recorded, not scored)
            self._give_up([ids[i] for i in todo[: len(todo) - self.max_lag]])
            todo = todo[len(todo) - self.max_lag :]
        todo = todo[: self.per_cycle]  # the next cycle judges what this one scored before taking more
        if todo:
            rows = reqs.take(pa.array(todo)).to_pylist()
            items = [
                ScoreItem(
                    r["request_id"], r["prompt_token_ids"], r["output_token_ids"], False, request_seed(0, r["seq"])
                )
                for r in rows
            ]
            for scored in self._score(items, served):
                run.append_reference(scored.reference, scored.prompt_reference, scored.seeded)
                self.scored.update(scored.reference.column("request_id").unique().to_pylist())
            if self.kind != "transformers":  # the upstream's (or deployment's) work, stated where the run is read
                run.manifest["reference"]["cost"] = dict(self.rescorer.cost)
                run.save_manifest()
        settled = {r for r in ids if r in self.scored or r in self.skipped or r in unscorable}
        judged = self._judge(run, reqs, settled, classes, reasons)
        t_submit = reqs.column("t_submit").to_pylist()
        arrivals = [t for r, t in zip(ids, t_submit) if r in self.scored and t]
        pending = [t for r, t in zip(ids, t_submit) if r not in settled]  # answered, waiting for the reference
        _atomic_json(
            self.path / STATUS,
            {
                "recorded": len(ids),
                "scored": len(self.scored),
                "skipped": len(self.skipped),
                "windows": self.windows,
                "newest_scored_arrival": max(arrivals) if arrivals else None,
                # the scoring lag: answered samples not yet scored, and the arrival of the oldest of them
                "pending": len(pending),
                "oldest_pending_arrival": min((t for t in pending if t), default=None),
                "failed": _count(c for c in classes.values() if c is not None),
                "unscored": _count(x for x in reasons.values() if x is not None),
                # a server reference's work: requests, tokens (prompts included), seconds (None: transformers)
                "reference_cost": dict(self.rescorer.cost) if self.kind != "transformers" else None,
                "pid": os.getpid(),
                "t": time.time(),
            },
        )
        return judged

    def _judge(self, run: RunDir, reqs: pa.Table, settled: set[str], classes: dict, reasons: dict) -> int:
        from lpf.watch.windows import judge_window

        ready = [
            (s, r)
            for r, s in zip(reqs.column("request_id").to_pylist(), reqs.column("seq").to_pylist())
            if r in settled and r not in self.judged
        ]
        ready.sort()
        done = 0
        temps = {}
        for t in self.watch.values():
            temps.update(zip(t.column("request_id").to_pylist(), t.column("temperature").to_pylist()))
        arrival = dict(zip(reqs.column("request_id").to_pylist(), reqs.column("t_submit").to_pylist()))
        n_full = len(ready) // self.window * self.window
        # every full window's rows in one scan of the parts (a scan per window is quadratic over a long watch)
        batch = [r for _, r in ready[:n_full] if r in self.scored]
        rows = {t: _rows(run, t, batch, self.part_ids) for t in ("requests", "tokens", "reference")} if batch else {}
        while len(ready) >= self.window:
            chunk, ready = ready[: self.window], ready[self.window :]
            ids = [r for _, r in chunk]
            scored_ids = [r for r in ids if r in self.scored]
            line = {
                "window": self.windows,
                "request_ids": ids,
                "n_settled": len(ids),
                "n_unscored": len(ids) - len(scored_ids),
            }
            before, tables = self.context, None
            if scored_ids:
                want = pa.array(scored_ids, pa.string())
                w_req_full, w_tok, w_ref = (
                    rows[t].filter(pc.is_in(rows[t].column("request_id"), value_set=want))
                    for t in ("requests", "tokens", "reference")
                )
                ts = {temps.get(r) for r in scored_ids}
                info = dict(self.info, temperature=ts.pop() if len(ts) == 1 else None)
                line.update(judge_window(w_req_full, w_tok, w_ref, self.context, info))
                tables = self.context = (w_req_full, w_tok, w_ref)
            else:
                line.update(alarm=False, verdicts={}, run_test={"result": None}, n_requests=0, n_tokens=0)
            # the window's extent and wall-clock span are all of its requests', failed ones included
            line["first_seq"], line["last_seq"] = chunk[0][0], chunk[-1][0]
            times = [arrival[r] for r in ids if arrival.get(r)]
            line["t_first"], line["t_last"] = (min(times), max(times)) if times else (None, None)
            line.update(window_facts([classes.get(r) for r in ids], [reasons.get(r) for r in ids]))
            line["result"] = window_result(line)
            self.incidents.note(line, tables, before)
            line["t"] = time.time()
            with open(self.path / WINDOWS, "a") as f:
                f.write(json.dumps(line, default=float) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.judged.update(ids)
            self.windows += 1
            done += 1
        return done


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _rows(run: RunDir, table: str, ids: list[str], part_ids: dict) -> pa.Table:
    """The rows of `ids` in `table`, reading only the parts that hold one of them (`part_ids`: a part's
    request ids, read once per part and kept: a committed part never changes, and an hour of watching
    commits thousands)."""
    want = pa.array(ids, pa.string())
    wanted = set(ids)
    columns = list(_schema(table).names)
    parts = []
    listed = run.parts(table)
    for gone in set(part_ids) - {(table, p.name) for p in listed} - {k for k in part_ids if k[0] != table}:
        del part_ids[gone]  # deleted by --retain
    for p in listed:
        key = (table, p.name)
        if key not in part_ids:
            got = _unless_pruned(p, lambda p: read_part(p, table, ["request_id"]))
            if got is None:
                continue
            part_ids[key] = set(got.column("request_id").to_pylist())
        if not part_ids[key] & wanted:
            continue
        t = _unless_pruned(p, lambda p: read_part(p, table, columns))
        if t is not None:
            parts.append(t.filter(pc.is_in(t.column("request_id"), value_set=want)))
    return pa.concat_tables(parts) if parts else _schema(table).empty_table()


def _unless_pruned(path: Path, read):
    """`read(path)`, or None when the part was deleted (by `--retain`) since it was listed."""
    try:
        return read(path)
    except (OSError, LpfError):
        if path.exists():
            raise
        return None


def _schema(table: str):
    from lpf.run import schema

    return schema.TABLES[table]


def _read_ids(path: Path) -> list[str]:
    return [x for x in path.read_text().split("\n") if x] if path.is_file() else []


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


@click.command(context_settings={"help_option_names": ["--help"]})
@click.argument("run", type=click.Path(path_type=Path))
@click.option(
    "--spec",
    "spec_file",
    type=click.File("r"),
    required=True,
    metavar="FILE|-",
    help="The scorer's settings (lpf.watch.spec.ScorerSpec as JSON; - reads stdin): lpf watch writes "
    "RUN/live/scorer-spec.json.",
)
def main(run: Path, spec_file) -> None:
    """Score and judge what `lpf watch` records into RUN, until killed."""
    from lpf.watch.spec import read_scorer_spec

    try:
        spec = read_scorer_spec(spec_file.read(), getattr(spec_file, "name", "-"))
    except LpfError as e:
        raise click.UsageError(str(e)) from None
    # SIGTERM (lpf watch stopping) unwinds through `finally`, so a local Ray this process started stops too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    scorer = Scorer(
        run,
        spec.reference,
        spec.dtype,
        spec.device,
        spec.window,
        token_budget=spec.token_budget,
        max_lag=spec.max_lag,
        executor=spec.executor,
        ray=spec.ray(),
        reference_model=spec.reference_model,
        reference_concurrency=spec.reference_concurrency,
    )
    try:
        # lpf watch killed outright (SIGKILL, OOM) cannot stop its scorer: an orphan (re-parented) stops itself
        while os.getppid() == parent:
            scorer.cycle()
            time.sleep(spec.poll)
    finally:
        scorer.close()


if __name__ == "__main__":
    sys.exit(main())
