"""A shrink candidate's configuration, and the original run it is cut from.

Contract:
- `Source.open(run_dir)` reads the run a shrink starts from (manifest, findings, summary, the
  requests in arrival order with each one's prompt and max_tokens, the engine's option defaults);
  an unfinished run is refused. `Source.target(request_id)` picks the request to shrink for: the
  given one, which must be flagged, or the worst flagged one; a run with nothing flagged, an unknown
  id or an unflagged one raise `LpfError` in one line. `Source.crash(request_id)` is the crash its
  failed requests share (`crash.run_crash`), the signature of a run that crashed instead of lying.
- A `Config` is which of the original requests run (by arrival index, in arrival order), how much
  of each prompt (a prefix) and how many output tokens each may produce (a request its client
  cancelled mid-prefill, `abort_after_tokens`, is cancelled at the same token while its prompt is longer),
  and the engine's knobs.
  `key()` identifies it (the cache of outcomes and a resume rely on it), `size()` orders candidates
  (requests, then tokens, then knobs away from the engine's defaults), `workload_items()` is the
  JSONL that runs it (ids are the original request ids, one rollout each), `to_json()` records it
  compactly relative to the source and `Source.config(doc)` reads that back.
- `Source.spec(config, workload, out)`: the `AuditSpec` that runs a config into `out`, with
  everything else (model, reference, sampling) taken from the original run, and the calibrated
  verdict thresholds pinned so every candidate is judged by the original's yardstick.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean
from lpf.core.knobs import shrink_knobs

PINNED_THRESHOLDS = ("clean_abs_diff", "divergent_abs_diff", "tie_margin")


@dataclass(frozen=True)
class Member:
    seq: int  # arrival index in the original run
    prompt_len: int  # a prefix of the original prompt
    max_tokens: int


@dataclass(frozen=True)
class Config:
    members: tuple[Member, ...]  # arrival order
    knobs: tuple[tuple[str, object], ...]  # every engine option, sorted by name

    @classmethod
    def of(cls, members, knobs: dict) -> "Config":
        return cls(tuple(sorted(members, key=lambda m: m.seq)), tuple(sorted(knobs.items())))

    @property
    def knob_dict(self) -> dict:
        return dict(self.knobs)

    def with_members(self, members) -> "Config":
        return Config.of(members, self.knob_dict)

    def with_member(self, member: Member) -> "Config":
        return self.with_members([member if m.seq == member.seq else m for m in self.members])

    def with_knob(self, name: str, value) -> "Config":
        return Config.of(self.members, {**self.knob_dict, name: value})

    def member(self, seq: int) -> Member:
        return next(m for m in self.members if m.seq == seq)

    def index(self, seq: int) -> int:
        """The arrival index of original request `seq` in a run of this config."""
        return next(i for i, m in enumerate(self.members) if m.seq == seq)

    def key(self) -> str:
        text = json.dumps([[list(m.__dict__.values()) for m in self.members], self.knobs], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Source:
    path: Path
    manifest: dict
    findings: dict
    summary: list[dict]  # summary.parquet rows, arrival order
    prompts: dict[int, tuple[int, ...]]  # seq -> prompt token ids
    ids: dict[int, str]  # seq -> request id
    expected: dict[int, str | None]
    max_tokens: dict[int, int]
    defaults: dict  # the engine's option defaults
    aborts: dict = dataclasses.field(default_factory=dict)  # seq -> abort_after_tokens (a client's cancel)
    # the knobs moved toward the defaults, in this order: those with a shrink_order on the engine's
    # Options (lpf.core.knobs; the cache first: it sets how fast slots and blocks recycle)
    shrink_order: tuple[str, ...] = ()

    @classmethod
    def open(cls, run_dir: Path) -> "Source":
        import pyarrow.parquet as pq

        from lpf.adapters import get_engine_class
        from lpf.run.store import RunDir

        run = RunDir.open(run_dir)
        if run.manifest.get("status") != "complete":
            raise LpfError(
                f"{run.path} is an unfinished run: `lpf run --resume {run.path}` (then rescore and "
                f"analyze) first, so the shrink starts from every request"
            )
        fpath, spath = run.path / "findings.json", run.path / "summary.parquet"
        if not fpath.is_file() or not spath.is_file():
            raise LpfError(f"{run.path} has no findings yet: run `lpf analyze {run.path}` first")
        try:
            findings = json.loads(fpath.read_text())
        except json.JSONDecodeError as e:
            raise LpfError(f"{fpath}: unreadable JSON ({e.msg})") from None
        summary = (
            pq.read_table(spath, columns=["request_id", "seq", "verdict", "first_divergence", "max_abs_logprob_diff"])
            .sort_by("seq")
            .to_pylist()
        )
        req = (
            run.read(
                "requests",
                ["seq", "request_id", "prompt_id", "prompt_token_ids", "output_token_ids", "oracle_expected"],
            )
            .sort_by("seq")
            .to_pylist()
        )
        per_item, aborts = _item_max_tokens(run.path / "workload.jsonl")
        default_mt = run.manifest["sampling"]["max_tokens"]
        engine_cls = get_engine_class(run.manifest["engine"]["name"])
        return cls(
            path=run.path,
            manifest=run.manifest,
            findings=findings,
            summary=summary,
            prompts={r["seq"]: tuple(r["prompt_token_ids"]) for r in req},
            ids={r["seq"]: r["request_id"] for r in req},
            expected={r["seq"]: r["oracle_expected"] for r in req},
            max_tokens={r["seq"]: per_item.get(r["prompt_id"]) or default_mt for r in req},
            aborts={r["seq"]: aborts[r["prompt_id"]] for r in req if aborts.get(r["prompt_id"])},
            defaults={name: f.default for name, f in engine_cls.Options.model_fields.items()},
            shrink_order=tuple(shrink_knobs(engine_cls.Options)),
        )

    # -- the request to shrink for -----------------------------------------------------------------
    def target(self, request_id: str | None) -> dict:
        flagged = [r for r in self.summary if r["verdict"] in ("divergent", "corrupt")]
        if not flagged:
            counts = self.findings.get("counts") or {}
            raise LpfError(
                f"{self.path} has no flagged request (verdict {self.findings.get('verdict')}: "
                f"{counts.get('divergent', 0)} divergent, {counts.get('corrupt', 0)} corrupt): nothing to shrink"
            )
        if request_id is None:
            order = {f["request_id"]: i for i, f in enumerate(self.findings.get("flagged") or [])}
            return min(flagged, key=lambda r: (order.get(r["request_id"], len(order)), r["seq"]))
        row = next((r for r in self.summary if r["request_id"] == request_id), None)
        if row is None:
            raise LpfError(
                f"{self.path} has no request {request_id!r}"
                f"{did_you_mean(request_id, [r['request_id'] for r in flagged])}"
            )
        if row["verdict"] not in ("divergent", "corrupt"):
            raise LpfError(
                f"request {request_id} is {row['verdict']} in {self.path}, not flagged: nothing to shrink "
                f"(flagged: {', '.join(r['request_id'] for r in flagged[:3])}{', ...' if len(flagged) > 3 else ''})"
            )
        return row

    def crash(self, request_id: str | None = None):
        """(crash.Crash, how many requests it failed, the first one's id) when requests of the run
        failed with an exception (the given request's, or the one most failures share), else None."""
        from lpf.experiments.shrink.crash import parse_crash, run_crash
        from lpf.run.store import RunDir

        requests = RunDir(self.path, self.manifest).read("requests", ["seq", "request_id", "error"])
        if request_id is None:
            return run_crash(requests)
        row = next((r for r in requests.to_pylist() if r["request_id"] == request_id), None)
        crash = parse_crash(row["error"]) if row else None
        if crash is None:
            return None
        return crash, sum(crash.same(parse_crash(e)) for e in requests.column("error").to_pylist() if e), request_id

    def beside(self, seq: int) -> list[int]:
        """Arrival indexes of the later requests that ran beside request `seq`: in an engine step
        with it (from the trace), or, without a trace, submitted before it finished."""
        import pyarrow.compute as pc

        from lpf.run.store import RunDir

        run = RunDir(self.path, self.manifest)
        rid = self.ids[seq]
        by_id = {r: s for s, r in self.ids.items()}
        if run.has("trace"):
            trace = run.read("trace").select(["step", "request_id"])
            steps = trace.filter(pc.equal(trace.column("request_id"), rid)).column("step")
            rows = trace.filter(pc.is_in(trace.column("step"), value_set=pc.unique(steps)))
            later = {by_id.get(r) for r in rows.column("request_id").to_pylist()}
        else:
            req = run.read("requests", ["seq", "t_submit", "t_finish"]).to_pylist()
            end = next((r["t_finish"] for r in req if r["seq"] == seq), None)
            later = {r["seq"] for r in req if end is not None and r["t_submit"] is not None and r["t_submit"] <= end}
        return sorted(s for s in later if s is not None and s > seq)

    def suspects(self, seq: int) -> dict[int, str]:
        """Arrival indexes of the requests the trace ties to request `seq`'s state, with why
        (`suspects.trace_suspects`); empty without a trace."""
        from lpf.experiments.shrink.suspects import trace_suspects
        from lpf.run.store import RunDir

        run = RunDir(self.path, self.manifest)
        if not run.has("trace"):
            return {}
        by_id = {r: s for s, r in self.ids.items()}
        named = trace_suspects(run.read("trace"), self.ids[seq])
        return {by_id[r]: why for r, why in named.items() if r in by_id}

    def narrow_suspects(self, seq: int) -> dict[int, str]:
        """The few requests the first-ranked hypothesis' own mechanism ties to request `seq`
        (`suspects.narrow_suspects`: speculative decoding's), with why; empty for other hypotheses."""
        from lpf.experiments.shrink.suspects import narrow_suspects
        from lpf.run.store import RunDir

        run = RunDir(self.path, self.manifest)
        top = (self.findings.get("hypotheses") or [{}])[0] or {}
        if not run.has("trace"):
            return {}
        by_id = {r: s for s, r in self.ids.items()}
        named = narrow_suspects(run.read("trace"), self.ids[seq], top.get("feature"))
        return {by_id[r]: why for r, why in named.items() if r in by_id}

    def named_moves(self, config: "Config"):
        """(what, [{knob: value}]) the first-ranked hypothesis points at (`suspects.named_moves`), or None."""
        from lpf.adapters import get_engine_class
        from lpf.experiments.shrink.suspects import named_moves

        return named_moves(
            self.findings.get("hypotheses"), get_engine_class(self.manifest["engine"]["name"]).Options, config.knob_dict
        )

    def refused(self, config: "Config") -> str | None:
        """Why the engine's Options refuse this config's knobs (a drill that needs a knob moved off,
        say), or None: a refused knob move is not tried (its audit would stop the shrink)."""
        from lpf.adapters import get_engine_class

        try:
            get_engine_class(self.manifest["engine"]["name"]).Options(**config.knob_dict)
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError or LpfError: either way refused
            return " ".join(str(e).split())[:200]
        return None

    # -- configurations ----------------------------------------------------------------------------
    def original(self) -> Config:
        knobs = dict(self.manifest["engine"].get("options") or {})
        return Config.of([Member(s, len(p), self.max_tokens[s]) for s, p in self.prompts.items()], knobs)

    def off_default(self, config: Config) -> dict:
        return {k: v for k, v in config.knobs if v is not None and v != self.defaults.get(k)}

    def movable(self, config: Config) -> list[str]:
        """The knobs to move toward the engine's defaults, in the engine's shrink order (the drill under
        study has none: it is not moved)."""
        off = self.off_default(config)
        return [k for k in self.shrink_order if k in off]

    def size(self, config: Config) -> tuple[int, int, int]:
        return (
            len(config.members),
            sum(m.prompt_len + m.max_tokens for m in config.members),
            len(self.movable(config)),
        )

    def describe_size(self, config: Config) -> str:
        n, tokens, knobs = self.size(config)
        return f"{n} request{'s' * (n != 1)}, {tokens} tokens, {knobs} knob{'s' * (knobs != 1)} off default"

    def workload_items(self, config: Config) -> list[dict]:
        items = []
        for m in config.members:
            prompt = self.prompts[m.seq]
            item = {"id": self.ids[m.seq], "prompt_token_ids": list(prompt[: m.prompt_len]), "max_tokens": m.max_tokens}
            if m.prompt_len == len(prompt) and self.expected.get(m.seq) is not None:
                item["expected"] = self.expected[m.seq]  # a cut prompt asks something else
            if self.aborts.get(m.seq) and self.aborts[m.seq] < m.prompt_len:  # the client cancels it as it did
                item["abort_after_tokens"] = self.aborts[m.seq]
            items.append(item)
        return items

    def to_json(self, config: Config) -> dict:
        """Compact: arrival-index ranges, the lengths that differ from the original, the knobs off default."""
        seqs = [m.seq for m in config.members]
        ranges, start = [], None
        for i, s in enumerate(seqs):
            if start is None:
                start = s
            if i + 1 == len(seqs) or seqs[i + 1] != s + 1:
                ranges.append([start, s])
                start = None
        lengths = {
            str(m.seq): [m.prompt_len, m.max_tokens]
            for m in config.members
            if (m.prompt_len, m.max_tokens) != (len(self.prompts[m.seq]), self.max_tokens[m.seq])
        }
        return {"seqs": ranges, "lengths": lengths, "knobs": self.off_default(config)}

    def config(self, doc: dict) -> Config:
        members = []
        for a, b in doc["seqs"]:
            for s in range(a, b + 1):
                plen, mt = doc["lengths"].get(str(s), (len(self.prompts[s]), self.max_tokens[s]))
                members.append(Member(s, plen, mt))
        knobs = {k: v for k, v in self.original().knobs}
        knobs = {k: (doc["knobs"][k] if k in doc["knobs"] else self.defaults.get(k, v)) for k, v in knobs.items()}
        knobs.update({k: v for k, v in doc["knobs"].items() if k not in knobs})  # moved on from the run's
        return Config.of(members, knobs)

    # -- running a config --------------------------------------------------------------------------
    def spec(self, config: Config, workload: Path, out: Path):
        """The AuditSpec of a candidate: one rollout per request, the original's sampling (its output
        positions: prompt logprobs are not asked for) and reference, the knobs off the defaults."""
        from lpf.core.sampling import SamplingParams
        from lpf.pipeline.spec import AuditSpec, RunSpec

        m, s = self.manifest, self.manifest["sampling"]
        sampling = SamplingParams(
            **{k: s[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs")},
            ignore_eos=bool(s.get("ignore_eos")),
        )
        run = RunSpec(
            engine=m["engine"]["name"],
            model=self.model_spec(),
            workload=str(workload),
            out=out,
            n=1,
            sampling=sampling,
            engine_options=self.off_default(config),
        )
        ref = m.get("reference") or {}
        rescore = dataclasses.replace(
            AuditSpec.model_fields["rescore"].default,
            dtype=ref.get("dtype") or "float32",
            reference=ref["spec"] if ref.get("spec") and ref["spec"] != m["model"]["spec"] else None,
            # a server reference (`lpf.pipeline.reference_http`): the same server, asked the same way
            reference_model=ref.get("served_model") if ref.get("kind") == "http" else None,
            reference_concurrency=ref.get("concurrency") if ref.get("kind") in ("http", "self") else None,
            # a vLLM reference (`lpf.pipeline.reference_vllm`): the same knobs
            reference_option=tuple(f"{k}={v}" for k, v in (ref.get("options") or {}).items())
            if ref.get("kind") == "vllm"
            else (),
        )
        return AuditSpec(run=run, rescore=rescore, thresholds=self.threshold_values())

    def model_spec(self) -> str:
        model = self.manifest["model"]
        spec = model["spec"]
        return spec if spec.startswith(("zoo:", "tiny:")) else model["path"]

    def threshold_values(self) -> dict:
        """The thresholds the original run calibrated, and those its user pinned: {name: value}."""
        th = self.findings.get("thresholds") or {}
        names = list(PINNED_THRESHOLDS) + [p for p in th.get("pinned") or [] if p not in PINNED_THRESHOLDS]
        return {n: th[n] for n in names if isinstance(th.get(n), (int, float))}

    def thresholds(self) -> list[str]:
        """The same as NAME=VALUE text (for the report)."""
        return [f"{n}={v!r}" for n, v in self.threshold_values().items()]


def _item_max_tokens(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(prompt id -> the item's own max_tokens, prompt id -> its abort_after_tokens), from the run's
    normalized workload."""
    if not path.is_file():
        return {}, {}
    out, aborts = {}, {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            if d.get("max_tokens"):
                out[d["id"]] = d["max_tokens"]
            if d.get("abort_after_tokens"):
                aborts[d["id"]] = d["abort_after_tokens"]
    return out, aborts
