"""Running a configuration and judging it k-of-n: does the target still tell the same lie?

Contract:
- Each try is the candidate's `AuditSpec` (`Source.spec`) run as one cell (`cells.run_cell`: its
  own `lpf audit` process, since an engine such as vLLM cannot be re-sized in place, and an
  interrupted try is finished, not redone), into `DIR/candidates/<id>-<try>/`, its log in `DIR/logs/`, its workload in
  `DIR/workloads/<id>.jsonl`. A try whose directory is already complete is read, not rerun.
- `Judge.judge(cid, config, every_try=False) -> (reproduces, tries)`: a configuration reproduces
  when the lie shows in at least `need` of up to `tries` runs; runs stop once the outcome is
  decided. Engines can be nondeterministic, but most are not: once two runs of one configuration
  gave the target bit-identical tokens and logprobs, the engine counts as deterministic and one
  run decides every later configuration. `every_try=True` (the original configuration, whose failure
  is reported as "did not reproduce in K tries") always spends every try it needs.
- `top_up(cid, config, have)` runs a configuration until it has had every try (the minimum's
  confirmation on an engine not shown deterministic).
- `charge(name)` is called before every run (with the try's directory name) and raises
  `BudgetSpent` when the budget is used up.
- With a crash signature (`crash.Crash`: nothing was flagged, the requests failed with an exception)
  a try shows the lie when any request of it failed with the same exception from the same frame
  (`crash.shows_crash`); the target need not be in the run.
- A try reads the target's summary row and, when the signature names a feature, the target's value
  of it (`signature.target_feature`); a run whose model weights differ from the original's stops the
  shrink (`LpfError`): it would be shrinking some other model's lie.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from lpf.core.errors import LpfError
from lpf.experiments.shrink.config import Config, Source
from lpf.experiments.shrink.signature import SUMMARY_SIGNATURES, TOKEN_SIGNATURES, Signature, shows, target_feature


class BudgetSpent(Exception):
    """The shrink has used every run `--budget-runs` allows."""


class Judge:
    def __init__(
        self,
        out: Path,
        source: Source,
        signature: Signature,
        target_seq: int,
        tries: int,
        need: int,
        charge: Callable[[str], None],
        deterministic: bool | None = None,
        crash=None,
    ):
        self.out, self.source, self.signature, self.target_seq = Path(out), source, signature, target_seq
        self.crash = crash  # a crash.Crash: the lie is that crash in any request of the run
        self.tries, self.need, self.charge = tries, need, charge
        self.deterministic = deterministic  # None until two runs of one configuration say

    def judge(
        self, cid: str, config: Config, every_try: bool = False, on_try: Callable[[dict], None] = lambda t: None
    ) -> tuple[bool, list[dict]]:
        workload = self._workload(cid, config)
        tries: list[dict] = []
        for k in range(1, self.tries + 1):
            tries.append(self._try(f"{cid}-{k}", config, workload))
            on_try(tries[-1])
            lies = sum(t["lie"] for t in tries)
            if lies >= self.need:
                return True, tries
            if lies + self.tries - k < self.need:
                return False, tries
            if len(tries) >= 2 and self.deterministic is None:
                self.deterministic = tries[-1]["fingerprint"] == tries[-2]["fingerprint"]
            if self.deterministic and not every_try:
                return lies >= 1, tries  # a deterministic engine repeats itself: one run stands for all
        return False, tries

    def top_up(self, cid: str, config: Config, have: int, on_try: Callable[[dict], None] = lambda t: None) -> None:
        """Run configuration `cid` until it has had every try (`have` so far): how often it lies."""
        workload = self._workload(cid, config)
        for k in range(have + 1, self.tries + 1):
            on_try(self._try(f"{cid}-{k}", config, workload))

    def _workload(self, cid: str, config: Config) -> Path:
        d = self.out / "workloads"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{cid}.jsonl"
        text = "".join(json.dumps(item) + "\n" for item in self.source.workload_items(config))
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f".tmp-{path.name}")
            tmp.write_text(text)
            tmp.replace(path)
        return path

    def _try(self, name: str, config: Config, workload: Path) -> dict:
        from lpf.experiments import cells

        run_dir, log = self.out / "candidates" / name, self.out / "logs" / f"{name}.log"
        if not cells.cell_complete(run_dir):
            self.charge(name)
            log.parent.mkdir(parents=True, exist_ok=True)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            try:
                cells.run_cell(self.source.spec(config, workload, run_dir), log, name)
            except LpfError:
                if not (run_dir / "findings.json").is_file():
                    raise
                # the audit judged its requests and then said why it failed (every request failed in
                # the engine, say): for the shrink that is an outcome, the target's row says which
        if self.crash is not None:
            return self._read_crash(run_dir)
        return self._read(run_dir, config.index(self.target_seq))

    def _read_crash(self, run_dir: Path) -> dict:
        """A crash signature's try: did any request fail with the same exception from the same frame?"""
        from lpf.experiments.shrink.crash import parse_crash, shows_crash
        from lpf.run.store import RunDir

        run = RunDir.open(run_dir)
        requests = run.read("requests", ["seq", "request_id", "error", "output_token_ids"]).sort_by("seq")
        lie, seen = shows_crash(self.crash, requests)
        failed = next((r for r in requests.to_pylist() if r["error"]), None)
        c = parse_crash(failed["error"]) if failed else None
        what = [[r["request_id"], r["output_token_ids"], bool(r["error"])] for r in requests.to_pylist()]
        return {
            "dir": run_dir.relative_to(self.out).as_posix(),
            "request_id": failed["request_id"] if failed else None,
            "lie": lie,
            "seen": seen,
            "verdict": "error" if failed else None,
            "first_divergence": None,
            "max_abs_logprob_diff": None,
            "crash": c.to_dict() if c else None,
            # which requests failed and what the others produced: the same twice, the engine repeats itself
            "fingerprint": hashlib.sha256(json.dumps([what, c.describe() if c else None]).encode()).hexdigest()[:16],
        }

    def _read(self, run_dir: Path, index: int) -> dict:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from lpf.run.store import RunDir

        run = RunDir.open(run_dir)
        want = (self.source.manifest.get("model") or {}).get("weights_sha256")
        got = (run.manifest.get("model") or {}).get("weights_sha256")
        if want and got and want != got:
            raise LpfError(
                f"the model's weights changed since {self.source.path} was run (sha256 {got[:12]}... "
                f"instead of {want[:12]}...): a shrink must run the same model"
            )
        rows = pq.read_table(run_dir / "summary.parquet").to_pylist()
        row = next((r for r in rows if r["seq"] == index), None)
        requests = run.read("requests")
        rid = row["request_id"] if row else None
        value = self._feature(run, requests, index) if self.signature.feature and row else None
        lie, seen = shows(self.signature, row, value)
        tok = run.read("tokens", ["request_id", "position", "token_id", "engine_logprob"])
        mine = tok.filter(pc.equal(tok.column("request_id"), rid or "")).sort_by("position")
        fingerprint = hashlib.sha256(
            json.dumps([mine.column("token_id").to_pylist(), mine.column("engine_logprob").to_pylist()]).encode()
        ).hexdigest()[:16]
        return {
            "dir": run_dir.relative_to(self.out).as_posix(),
            "request_id": rid,
            "lie": lie,
            "seen": seen,
            "verdict": row["verdict"] if row else None,
            "first_divergence": row["first_divergence"] if row else None,
            "max_abs_logprob_diff": row["max_abs_logprob_diff"] if row else None,
            "fingerprint": fingerprint,
        }

    def _feature(self, run, requests, index: int):
        from lpf.analysis.thresholds import Thresholds

        trace = run.read("trace") if run.has("trace") else None
        tokens = reference = None
        if self.signature.feature in TOKEN_SIGNATURES:
            tokens, reference = run.read("tokens"), run.read("reference")
        th = Thresholds().with_overrides(self.source.thresholds())
        return target_feature(
            self.signature.feature,
            index,
            requests,
            trace,
            run.manifest.get("engine"),
            tokens,
            reference,
            run.manifest["sampling"].get("temperature") or 0.0,
            th,
            summary_for(run.path, self.signature.feature),
        )


def summary_for(run_dir: Path, feature: str | None):
    """A run's per-request summary when `feature` is a signature that reads where requests first diverged
    (`SUMMARY_SIGNATURES`), else None."""
    path = Path(run_dir) / "summary.parquet"
    if feature not in SUMMARY_SIGNATURES or not path.exists():
        return None
    import pyarrow.parquet as pq

    return pq.read_table(path)
