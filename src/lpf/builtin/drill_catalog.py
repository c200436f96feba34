"""Every built-in drill, declared once: its name, argument, preconditions, ground truth and the features
that name it. Pure data (no torch), so anything may read it without loading the engine.

Contract: `CATALOG` (name -> `Drill`, in `--help` order), `by_family(family)`, `engine_facts(names)` and
`markdown_table()`. Who reads what:
  faults.FaultSet            the field each drill sets (`Drill.field`), parsing and range of its argument
  adapters.builtin           `needs(options)`: the one-line reason a configuration cannot run the drill
  drill_truth.EXPECTED       `truth`: per ground-truth role, the per-request mechanism features that name it
  faults.Drills              `every_request`: the ground-truth detail of a drill that changes every request
  pipeline.trace.engine_info `facts(value)`: what the drill makes true of the engine, added to the engine
                             info analysis reads (analysis never sees a drill name, only these facts)
  bench/bugs.py, tests       `named_by`: the hypothesis features whose first rank names the drill; `knobs`:
                             the engine knobs its bug ran under
  docs/builtin-engine.md     `markdown_table()` between its `drills:begin` / `drills:end` markers
                             (`python -m lpf.builtin.drill_catalog --write` rewrites it; a test checks it)
What a drill does to the engine (its mechanism) stays in the engine's hooks: `faults.Drills`,
`prefix_drills.PrefixDrills`, `speculative_decode`, `numeric_drills`, the scheduler; how to add one:
docs/design.md, "How to add a drill".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

GROUP_SIZE = 128  # quantize-weights: inputs per quantization group


@dataclass(frozen=True)
class Arg:
    """A drill's one optional argument (`NAME:ARG`): the FaultSet field it sets, its type, default and range."""

    field: str
    kind: type
    default: float
    lo: float
    hi: float
    metavar: str


@dataclass(frozen=True)
class Drill:
    name: str
    family: str  # seed | prefix | speculative | kv | substitution | recurrent (the docs' sections)
    what: str  # one line: the mechanism it re-creates
    arg: Arg | None = None
    needs: tuple["Need", ...] = ()
    named_by: frozenset[str] = frozenset()
    truth: Mapping[str, frozenset[str]] | None = None  # role -> features; None: {"corrupted": named_by}
    knobs: Mapping[str, object] = field(default_factory=dict)
    facts: Callable[[object], dict] | None = None
    every_request: Callable[[object], str] | None = None  # ground truth: every request, this detail (its value)

    @property
    def field(self) -> str:
        return self.arg.field if self.arg else self.name.replace("-", "_")

    @property
    def spelled(self) -> str:
        return f"{self.name}[:{self.arg.metavar}]" if self.arg else self.name

    def expected(self) -> dict[str, set[str]]:
        """Ground-truth role -> the per-request mechanism features that name what happened."""
        if self.truth is not None:
            return {role: set(f) for role, f in self.truth.items()}
        return {"corrupted": set(self.named_by)} if self.named_by else {}

    def refusals(self, options) -> list[str]:
        """Why the engine's options cannot run this drill (one line each; none: they can)."""
        return [why for need in self.needs if (why := need.refusal(self.name, options)) is not None]


@dataclass(frozen=True)
class Need:
    """A precondition on the engine's options (builtin's EngineConfig): `label` for the docs, `ok(options)`,
    and the refusal's words after the drill's name (a function of the options where they say how to fix it)."""

    label: str
    ok: Callable[[object], bool]
    reason: str | Callable[[object], str]

    def refusal(self, name: str, options) -> str | None:
        if self.ok(options):
            return None
        reason = self.reason(options) if callable(self.reason) else self.reason
        return f"{name} {reason}"


PREFIX_CACHING = Need("--enable-prefix-caching", lambda o: o.enable_prefix_caching, "needs --enable-prefix-caching")
SPECULATION = Need("-E speculative=...", lambda o: bool(o.speculative), "needs -E speculative=ngram:K")
DRAFT_MODEL = Need(
    "a draft model",
    lambda o: not o.speculative or o.speculative.startswith("draft:"),
    "needs a draft model's probabilities: -E speculative=draft:MODEL:K",
)
CHECKPOINTS = Need(
    "--enable-prefix-caching",
    lambda o: o.enable_prefix_caching,
    "needs --enable-prefix-caching (its checkpoints are the cache's)",
)
MODE_ALL = Need(
    "mamba_cache_mode=all", lambda o: o.mamba_cache_mode == "all", "is vLLM's all-mode bug: add -E mamba_cache_mode=all"
)
MODE_ALIGN = Need(
    "mamba_cache_mode=align",
    lambda o: o.mamba_cache_mode == "align",
    "is vLLM's align-mode bug: leave mamba_cache_mode=align",
)
UNITS_DIFFER = Need(
    "mamba_block_size > block_size",
    lambda o: o.checkpoint_block_size > o.block_size,
    lambda o: "needs a Mamba block larger than the KV block (the two units differ): "
    f"add -E mamba_block_size={2 * o.block_size}",
)
FP8_KV = Need(
    "-E kv_cache_dtype=fp8",
    lambda o: getattr(o, "kv_cache_dtype", "auto") != "auto",
    "lives in a quantized KV cache: add -E kv_cache_dtype=fp8_e4m3 (or fp8_e5m2)",
)
NO_PREFIX_CACHING = Need(
    "no prefix caching",
    lambda o: not o.enable_prefix_caching,
    "runs without prefix caching (shared blocks are reference-counted)",
)
UNPADDED_WITH_CHECKPOINTS = Need(
    "no prefix caching",
    lambda o: not o.enable_prefix_caching,
    "runs without prefix caching (chunks that save checkpoints are scanned one at a time, unpadded)",
)


def _f(*names: str) -> frozenset[str]:
    return frozenset(names)


# a request whose prefill's state write wrapped decodes from a slot it never wrote
_WRAP = _f("slot_offset_over_wrap", "state_write_strayed", "max_state_slot") | {
    f"slot{b}_offset_over_2^{n}" for b in ("", "_byte") for n in (31, 32)
}
# the imposter: a first step run as a decode on a slot an earlier request had left its state in
_STALE = _f(
    "first_decode_uncomputed",
    "admitted_as_decode",
    "first_phase_decode",
    "first_slot_used_before",
    "first_step_one_token",
)


def _prefix(name: str, what: str, named_by: frozenset[str], *needs: Need, **kw) -> Drill:
    return Drill(name, "prefix", what, needs=(PREFIX_CACHING, *needs), named_by=named_by, **kw)


def _spec(name: str, what: str, named_by: frozenset[str], *needs: Need) -> Drill:
    return Drill(name, "speculative", what, needs=(SPECULATION, *needs), named_by=named_by)


_DRILLS = (
    Drill(
        "stale-state",
        "seed",
        "1 scheduled token = decode, reused slots not zeroed: a new request reads an earlier one's state",
        named_by=_f("first_decode_uncomputed", "admitted_as_decode", "first_slot_used_before", "first_step_one_token"),
        truth={"corrupted": _STALE, "discarded": _STALE},
    ),
    Drill(
        "offset-wrap",
        "seed",
        "prefill state offsets slot * stride computed modulo 2^BITS: past the wrap a final state lands elsewhere",
        Arg("offset_wrap_bits", int, 20, 1, 62, "BITS"),
        named_by=_f("slot_offset_over_wrap", "state_write_strayed", "max_state_slot"),
        truth={"wrapped": _WRAP, "corrupted": _WRAP, "overwritten": _f("state_overwritten")},
        facts=lambda bits: {"state_offset_wrap_bits": int(bits)},
    ),
    Drill(
        "batch-variant",
        "seed",
        "a split-K LM head whose float16 split count follows the batch size (noise)",
        every_request=lambda _: "logits from a batch-size-dependent split-K head",
    ),
    Drill(
        "swap-outputs",
        "seed",
        "every PERIOD steps two decoding requests receive each other's sample",
        Arg("swap_outputs_period", int, 25, 1, 62, "PERIOD"),
    ),
    Drill("processed-logprobs", "seed", "post-temperature/top-k/top-p logprobs reported as raw ones"),
    Drill(
        "kv-double-free",
        "seed",
        "a finished request's last KV block is freed twice: two live requests later share it",
        needs=(NO_PREFIX_CACHING,),
        named_by=_f("kv_overwritten"),
    ),
    Drill("lost-chunk-state", "seed", "a continuing prefill chunk starts from zero conv/SSM state"),
    _prefix(
        "conv-into-shared-block",
        "a short resumed chunk writes its conv state into the shared checkpoint (vllm#56196)",
        _f("short_resumed_chunk"),
    ),
    _prefix(
        "unaligned-chunk-hashed",
        "the pre-fix chunk rule: a block hashed as the state at its end holds a mid-block state (vllm#45477)",
        _f("resumed_truncated_state"),
        MODE_ALIGN,
    ),
    _prefix(
        "publish-before-write",
        "hashes published when scheduled; an aborted chunk leaves a hash naming an unwritten state (vllm#56525)",
        _f("resumed_from_aborted_publisher"),
    ),
    _prefix(
        "incomplete-block-cached",
        "state saved only at a chunk's end while every crossed block is hashed (vllm#34587)",
        _f("resumed_unwritten_state", "resumed_truncated_state"),
        MODE_ALL,
        knobs={"mamba_cache_mode": "all"},
    ),
    _prefix(
        "resume-wrong-units",
        "the resume index computed in KV blocks instead of Mamba blocks (vllm#55601)",
        _f("resumed_wrong_block"),
        UNITS_DIFFER,
        knobs={"mamba_block_size": 32},
    ),
    _prefix(
        "prefix-cache-inert",
        "the hashing block raised past the context: nothing ever hits (vllm#48401; a finding, not a verdict)",
        frozenset(),
    ),
    Drill(
        "stale-conv-on-reuse",
        "prefix",
        "a prefill's conv starts from what a reused, unzeroed slot holds (sglang#24717; no prefix caching)",
        named_by=_f("first_slot_used_before"),
    ),
    _spec(
        "spec-prefill-verify",
        "a 1 + K-token prompt prefilled on the verify path, on the null slot (vllm#49918)",
        _f("prompt_on_verify_path"),
    ),
    _spec(
        "spec-accepted-permuted",
        "accepted counts applied to the rollback in the persistent batch's order (vllm#51571)",
        _f("state_rolled_back_wrong"),
    ),
    _spec(
        "spec-no-rollback",
        "no rollback: rejected drafts stay in the state",
        _f("state_kept_rejected_drafts"),
    ),
    _spec(
        "spec-checkpoint-rejected",
        "a checkpoint inside an accepted run saved from the verify pass's last position (vllm#57278)",
        _f("resumed_overshot_state"),
        CHECKPOINTS,
    ),
    _spec(
        "spec-draft-probs-permuted",
        "draft probabilities read by the permuted batch row: verified against another request's q (1Cat-vLLM#656)",
        _f("spec_decision_against_odds", "sampled_spec_batch_over_2"),
        DRAFT_MODEL,
    ),
    Drill(
        "kv-scale-from-position",
        "kv",
        "decode reads K/V rows from position P - 1 on with another scale than they were written with: logprobs "
        "from absolute position P on (vllm#54035, sglang#25790: FA3's 96-token decode tile)",
        Arg("kv_scale_from_position", int, 97, 1, 65536, "P"),
        needs=(FP8_KV,),
        named_by=_f("positional_onset"),
        knobs={"kv_cache_dtype": "fp8_e4m3"},
    ),
    Drill(
        "kv-offload-scales-lost",
        "kv",
        "a prefix-cache hit's reused blocks come back from the host tier without their scales, read with 1.0 "
        "(sglang#29913)",
        needs=(PREFIX_CACHING, FP8_KV),
        named_by=_f("prefix_cache_hit"),
        knobs={"kv_cache_dtype": "fp8_e4m3", "kv_cache_scales": "block"},
    ),
    Drill(
        "kv-requant-on-hit",
        "kv",
        "a prefix-cache hit's reused K/V quantized a second time (the scale applied twice)",
        needs=(PREFIX_CACHING, FP8_KV),
        named_by=_f("prefix_cache_hit"),
        knobs={"kv_cache_dtype": "fp8_e4m3"},
    ),
    Drill(
        "kv-fp4-collapse",
        "kv",
        "fp4 (e2m1) KV whose decode writes divide the block scales by an unset global scale: NaN K/V, the argmax "
        "collapses to token id 0 (vllm PR #49818)",
        named_by=_f("collapsed_to_one_token"),
    ),
    Drill(
        "quantize-weights",
        "substitution",
        "decoder linear weights rounded group-wise to BITS bits at load: a quantized checkpoint",
        Arg("quantize_weights_bits", int, 4, 2, 16, "BITS"),
        every_request=lambda bits: f"decoder linear weights rounded to {bits} bits "
        f"(groups of {GROUP_SIZE} inputs, round-to-nearest)",
    ),
    Drill(
        "kv-quant",
        "substitution",
        "K and V rounded to BITS bits as they are written to the paged cache",
        Arg("kv_quant_bits", int, 8, 2, 16, "BITS"),
        every_request=lambda bits: f"K/V rounded to {bits} bits (absmax per token and head) in the cache",
    ),
    Drill(
        "perturb-weights",
        "substitution",
        "decoder linear weights times (1 + SCALE N(0, 1)): another fine-tune",
        Arg("perturb_weights_scale", float, 0.01, 1e-6, 1.0, "SCALE"),
        every_request=lambda scale: f"decoder linear weights times (1 + {scale:g} N(0, 1))",
    ),
    Drill(
        "sampling-temperature",
        "substitution",
        "every request sampled at temperature T, its logprobs from that distribution, claimed raw",
        Arg("sampling_temperature", float, 0.8, 0.05, 10.0, "T"),
        every_request=lambda t: f"sampled at temperature {t:g}, logprobs from that distribution, "
        "whatever the client asked",
    ),
    Drill(
        "lm-head-bf16",
        "substitution",
        "the LM head's logits rounded to bfloat16 (MiniMax-M1's train/inference mismatch, fixed by an fp32 head)",
        every_request=lambda _: "LM head logits rounded to bfloat16 before sampling and logprobs",
    ),
)

# The 2026 reports on Gated DeltaNet / Kimi Delta Attention hybrids (issue 54). Each is a mechanism of the
# shared Mamba state protocol (`mamba_base`, `speculative_decode`, `prefix_drills`), so each runs on every
# state-slot mixer (GDN and Mamba; `padding-updates-state` on the mixers with a gated decay: GDN, Mamba2).
_RECURRENT_DRILLS = (
    Drill(
        "snapshot-never-written",
        "recurrent",
        "no state snapshot is ever written at a prefix-cache block boundary: a hit restores what the slot held "
        "(sglang#31474, KDA)",
        needs=(PREFIX_CACHING,),
        named_by=_f("resumed_unwritten_state"),
    ),
    Drill(
        "spec-verify-zero-state",
        "recurrent",
        "the verify path replays the drafts from a zero-filled state buffer, not the request's state "
        "(sglang#27658's review)",
        needs=(SPECULATION,),
        named_by=_f("speculated", "diverged_at_first_spec_decode"),
    ),
    Drill(
        "chunk-state-transposed",
        "recurrent",
        "a continuing prefill chunk reads its SSM state in the other layout ([d_v, d_k] for [d_k, d_v]) (vllm#41292)",
        named_by=_f("chunked_prefill"),
    ),
    Drill(
        "spec-state-block-zero",
        "recurrent",
        "after a verify step the state of its first position (block 0) is kept, not the last accepted "
        "token's (vllm#39273)",
        needs=(SPECULATION,),
        named_by=_f("state_rolled_back_wrong"),
    ),
    Drill(
        "spec-state-before-accept",
        "recurrent",
        "the verified state committed before the accepted count is known: with the request's previous "
        "count (sglang#36537)",
        needs=(SPECULATION,),
        named_by=_f("state_rolled_back_wrong"),
    ),
    Drill(
        "padding-updates-state",
        "recurrent",
        "in a batched prefill of mixed-length chunks the padding's gates decay the state (mlx-lm#1736)",
        needs=(UNPADDED_WITH_CHECKPOINTS,),
        named_by=_f("prefill_padded"),
    ),
    Drill(
        "state-fp16",
        "recurrent",
        "the SSM state rounded to float16 at every write while the cache claims its own dtype "
        "(TensorRT-Model-Connect#725)",
        every_request=lambda _: "SSM state rounded to float16 at every write",
    ),
)
_DRILLS += _RECURRENT_DRILLS
CATALOG: dict[str, Drill] = {d.name: d for d in _DRILLS}


def by_family(family: str) -> list[Drill]:
    return [d for d in _DRILLS if d.family == family]


def engine_facts(names: list[str]) -> dict:
    """What the drills in force (`FaultSet.names()` spelling, "offset-wrap:18") make true of the engine, as
    engine-info keys analysis reads. Unknown names (another engine's drills) contribute nothing."""
    out: dict = {}
    for spelled in names:
        name, _, arg = spelled.partition(":")
        drill = CATALOG.get(name)
        if drill is None or drill.facts is None:
            continue
        value = drill.arg.kind(float(arg)) if drill.arg and arg else (drill.arg.default if drill.arg else True)
        out.update(drill.facts(value))
    return out


def markdown_table() -> str:
    """The docs' table of every drill (docs/builtin-engine.md, between the drills markers)."""
    rows = ["| drill | family | needs | named by (first hypothesis) | re-creates |", "|---|---|---|---|---|"]
    for d in _DRILLS:
        needs = ", ".join(n.label for n in d.needs) or "-"
        named = ", ".join(f"`{f}`" for f in sorted(d.named_by)) or "-"
        rows.append(f"| `{d.spelled}` | {d.family} | {needs} | {named} | {d.what} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- drills:begin (python -m lpf.builtin.drill_catalog --write) -->", "<!-- drills:end -->"


def _write(doc: Path) -> bool:
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{markdown_table()}{END}{tail}"
    doc.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write"]:
        print("rewrote" if _write(Path(__file__).resolve().parents[3] / "docs" / "builtin-engine.md") else "unchanged")
    else:
        print(markdown_table(), end="")
