"""Expected floors: how far an honest implementation at the engine's dtype departs from the reference.

Contract:
  floor_stats(d, s, topk=None) -> floor dict: from per-token d (logprob error of the engine's
      token), s (its sensitivity, `token_evidence.sensitivity`) and, where top-k was compared, the arrays
      of `token_evidence.topk_spread` (w: spread of the shared top-k logprob errors, KL, top-2 margin):
        token           median and q99 of |d| / s over tokens with s >= S_MIN (nats of logit error)
        settled         q99 of |d| over the others (the rounding left where both sides are sure)
        topk            median and q99 of w, mean KL (None without top-k)
        margin          q99 and max of how far the reference's top-2 margin moved, over contested
                        positions (`token_evidence.topk_spread`; None without them)
        token_abs_diff  median and MAD of |d| (the per-request thresholds' statistics, as
                        `calibration.noise_floor` has them)
        n_tokens
  expected_floor(table, engine_dtype, reference_dtype, model=None, calibration=None) -> floor dict
      plus `source`, `pair`, `tie_margin` (or None when nothing is known for the reference's dtype).
      A calibration run's floor (the reference at the engine's dtype: `calibration`, floor_stats of
      calibration - reference) wins; otherwise the shipped table (`floors.json`, loaded by
      `lpf.pipeline.analyze`): the row measured on the run's reference model when there is one,
      else UNMEASURED_MARGIN times the envelope over the trained models measured (a larger model's
      kernels can err more than the small ones measured here; `--calibrate` measures the model
      itself). The tiny random models are left out of the envelope: with flat distributions and a
      large init they err 4-8x more in bfloat16 than any trained model, so they keep their own rows.
      Either way it is at least the table's floor for the reference's dtype against itself: two honest float32 implementations differ by their
      kernels, which a calibration run at the reference's own dtype cannot see. An engine whose
      dtype is unknown (a server's `auto`) is judged by the pair its own token errors fit
      (`observed`: `observed_logit_error` of the run; `infer_pair`: nearest median logit error, from
      INFER_MIN_TOKENS unsure tokens on; `inferred_dtype` in the floor); with too few tokens, the most
      lenient pair measured for that reference dtype. Either way the floor's detail says so.
  `configuration` (`configured_kv` of the manifest's engine configuration: a quantized KV cache, llama.cpp's
      flash attention on an f32 cache; an fp8 cache written at scale 1.0 is `kv=fp8_e4m3 scale=1`, vLLM's own
      row): the row `"{pair} kv={kv}"` measured for it, named in the detail and as
      `configured` ({kv, why}); a configuration with no measured row is judged by the plain pair (said in the
      detail), so an unmeasured quantization stays caught as before. A float32 engine that says nothing of its KV
      cache (`kv_seen`: its top-k spread, `kv_signature`) is judged by the `kv=float16` row when its spread sits
      nearer it than float32's own: `configured` then carries `inferred` (what to declare), said in the detail.
  `settings` (when floors.json says): the prompts and knob settings the row was measured over
      (scripts/measure_floor_settings.py widens float32's over long shared-prefix prompts, chunked
      prefill and prefix caching, where an honest engine's top-k spread was 5x the zoo:stress floor;
      scripts/measure_floor_prose.py bfloat16's over greedy prose, where it was 2.8x), the pair's own
      where it has them, else the reference dtype's against itself.
  tie_margin = max(1e-3, KAPPA * margin.q99): a greedy flip is explained when the reference's margin
      between the two tokens is within twice what honest implementations at the dtype pair move a
      contested top-2 margin by at their 99th percentile (measured: bfloat16 moves it by up to ~0.5
      nats on zoo:hybrid).
  honest (when floors.json has it): per component (token, settled, topk), the largest departure
      (`departure`) an honest implementation outside the reference's own arithmetic showed against the
      row (llama.cpp's f32 kernels, other thread counts and batch shapes, ...: the table's `honest`
      blocks, measured by scripts/measure_honest.py); carried into the expected floor.
  The departure from a floor (`departure_units`, `departure`, `departure_needed`) is `lpf.analysis.departure`'s.
Pure: the table comes in as a dict.
"""

from __future__ import annotations

import numpy as np

from lpf.analysis.departure import COMPONENTS, MIN_UNIT, S_MIN

KAPPA = 2.0  # honest implementations of one dtype pair stay under KAPPA x its 99th percentile
# a model outside the table: its kernels' error may exceed the small models measured here (float32's
# floor varied 17x between them), so their envelope is widened this much
UNMEASURED_MARGIN = 4.0
MIN_TIE = 1e-3
_SAMPLE = 1_000_000
# an engine of unknown dtype is judged by the pair its token errors fit once this many unsure tokens are scored
INFER_MIN_TOKENS = 30
# references that are servers (`lpf.pipeline.reference_http` and the like): their floor is the engine against a
# second pass of the same arithmetic, measured per kind (`{engine}/{reference} ref={kind}` rows), not float32's
SERVER_REFERENCES = {
    "self": "its own prefill (a self-reference)",
    "http": "a second deployment of itself (a trusted server)",
    "vllm": "vLLM's offline reference configuration",
}


def _qs(x: np.ndarray, *qs: float) -> list[float | None]:
    """Quantiles of the finite values of x (one partition for all of them); Nones when there are none."""
    x = x[np.isfinite(x)]
    return [float(v) for v in np.quantile(x, qs)] if x.size else [None] * len(qs)


def floor_stats(d: np.ndarray, s: np.ndarray, topk: dict | None = None) -> dict:
    step = max(1, d.size // _SAMPLE)  # quantiles of a 20M-token run need not read every token
    d, s = np.abs(d[::step]), s[::step]
    informative = s >= S_MIN
    with np.errstate(divide="ignore", invalid="ignore"):
        u = d[informative] / s[informative]
    med = _qs(d, 0.5)[0]
    u_med, u99 = _qs(u, 0.5, 0.99)
    out = {
        "token": {"median": u_med, "q99": u99},
        "settled": {"q99": _qs(d[~informative], 0.99)[0]},
        "topk": None,
        "margin": None,
        "token_abs_diff": {
            "median": med,
            "mad": None if med is None else float(1.4826 * np.median(np.abs(d[np.isfinite(d)] - med))),
        },
        "n_tokens": int(np.isfinite(d).sum()) * step,
    }
    if topk is not None and np.isfinite(topk["w"]).any():
        w, kl, margin = (topk[k][::step] for k in ("w", "kl", "margin"))
        w_med, w99 = _qs(w, 0.5, 0.99)
        out["topk"] = {"median": w_med, "q99": w99, "kl_mean": float(np.nanmean(kl)) if np.isfinite(kl).any() else None}
        if np.isfinite(margin).any():
            m_med, m99, m_max = _qs(margin, 0.5, 0.99, 1.0)
            out["margin"] = {"median": m_med, "q99": m99, "max": m_max, "n": int(np.isfinite(margin).sum())}
    return out


_FIELDS = (
    ("token", "median"),
    ("token", "q99"),
    ("settled", "q99"),
    ("topk", "median"),
    ("topk", "q99"),
    ("margin", "q99"),
    ("margin", "max"),
    ("token_abs_diff", "median"),
    ("token_abs_diff", "mad"),
)


def envelope(*floors: dict | None) -> dict:
    """Field by field the largest of `floors` (None entries and values skipped)."""
    out: dict = {"token": {}, "settled": {}, "topk": {}, "margin": {}, "token_abs_diff": {}}
    for group, name in _FIELDS:
        values = [f[group][name] for f in floors if f and f.get(group) and f[group].get(name) is not None]
        out[group][name] = max(values) if values else 0.0
    return out


def tie_margin(floor: dict) -> float:
    return max(MIN_TIE, KAPPA * (floor.get("margin") or {}).get("q99", 0.0))


def _row(table: dict, pair: str, model: str | None) -> tuple[dict | None, str]:
    """(the pair's floor for `model`, how it was chosen): the model's own row when it was measured,
    else the envelope over the trained models times UNMEASURED_MARGIN."""
    entry = (table.get("pairs") or {}).get(pair)
    if not entry:
        return None, ""
    if model and model in (entry.get("models") or {}):
        return entry["models"][model], f"measured on {model}"
    n = sum(1 for m in entry.get("models") or {} if m.startswith("zoo:"))
    return _scaled(
        entry.get("envelope"), UNMEASURED_MARGIN
    ), f"{model or 'this model'} not measured: {UNMEASURED_MARGIN:g}x the envelope over the {n} trained models"


def _honest(table: dict, pair: str, model: str | None) -> dict:
    """The largest departures honest implementations showed at `pair`, relative to that pair's own row:
    the model's row's, else the envelope's. Another pair's are not carried over (a departure is a ratio
    to its own floor: float32's llama.cpp departures are 3,600x too lenient against bfloat16's floor)."""
    entry = (table.get("pairs") or {}).get(pair) or {}
    row = (entry.get("models") or {}).get(model or "") or entry.get("envelope") or {}
    return {c: float(v) for c, v in (row.get("honest") or {}).items() if c in COMPONENTS and v is not None}


def _most_lenient(rows: dict[str, tuple[dict | None, str]]) -> str:
    """Of `_row`'s answers by pair, the pair whose token floor is widest (what an unknown dtype is judged by)."""
    return max(rows, key=lambda p: (rows[p][0] or {}).get("token", {}).get("q99") or 0.0)


def _scaled(floor: dict | None, factor: float) -> dict | None:
    if floor is None:
        return None
    out = envelope(floor)
    for group, name in _FIELDS:
        out[group][name] *= factor
    return out


# llama.cpp's KV type names, as the table's rows name them
_KV_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def configured_kv(engine_name: str | None, engine_dtype: str | None, block: dict | None) -> dict | None:
    """{kv, why}: the KV cache precision the engine's configuration (`manifest.engine.configuration`, values
    read from the engine or declared) computes attention with, when it is not the engine's dtype; None when it
    is. A quantized KV cache names itself (`kv_cache_dtype`), qualified `scale=1` when the engine says it writes
    an fp8 cache at scale 1.0 (`kv_cache_scale`: vLLM's default without checkpoint scales); llama.cpp's flash attention on a float32 KV
    cache computes on an f16 copy of it (docs/bugs.md 18), so its KV is float16; and a llama-server that
    does not say (a user-started one: /props names neither) has its defaults assumed, said in `why`: an f16
    KV cache, or flash attention (auto: on) over an f32 one, float16 either way."""
    conf = block or {}

    def value(field):
        return (conf.get(field) or {}).get("value")

    kv = value("kv_cache_dtype")
    kv = _KV_NAMES.get(kv, kv)
    if kv and kv != engine_dtype:
        if str(kv).startswith("fp8") and value("kv_cache_scale") == 1.0:
            # written at scale 1.0 (vLLM without checkpoint scales): small K/V values fall into fp8's subnormals,
            # another arithmetic than a cache scaled from its values' range (the plain `kv=fp8_*` rows)
            return {"kv": f"{kv} scale=1", "why": f"a {kv} KV cache written at scale 1.0 (no calibrated scales)"}
        return {"kv": str(kv), "why": f"a {kv} KV cache"}
    vias = " ".join(str((conf.get(f) or {}).get("via") or "") for f in conf)
    llamacpp = engine_name == "llamacpp" or "llama-server" in vias or "/props" in vias
    if not llamacpp or engine_dtype != "float32":
        return None
    fa = value("flash_attention")
    if fa == "on" and kv in (None, "float32"):
        return {
            "kv": "float16",
            "why": "flash attention's f16 copy of the f32 KV cache (llama.cpp: docs/bugs.md 18; -fa off for exact "
            "float32)",
        }
    if fa is None or kv is None:  # what a server the user started does not say (its /props names neither)
        return {
            "kv": "float16",
            "why": "llama-server's defaults, assumed (it does not say its KV cache type or flash attention): an "
            "f16 KV cache (-ctk f16), or flash attention's f16 copy of an f32 one (-fa auto); declare "
            "--flash-attention off --kv-cache-dtype float32 for exact float32",
        }
    return None


def observed_logit_error(d: np.ndarray, ref_logprob: np.ndarray) -> dict:
    """What `infer_pair` classifies: {median, n}: the run's median logit error |d| / s_up over the tokens the
    reference is unsure of (s_up = sqrt(2) (1 - p) >= S_MIN: an upper bound of the sensitivity, from the
    reference's logprob alone); {abs_median, abs_n}: the median |d| over every token (a trained model on its
    own tasks is sure of most tokens). Medians: the lies of a minority of tokens (a tampered server) do not
    move them."""
    step = max(1, d.size // _SAMPLE)
    d, lp = np.abs(np.asarray(d[::step], dtype=np.float64)), np.asarray(ref_logprob[::step], dtype=np.float64)
    s_up = np.sqrt(2.0) * -np.expm1(np.minimum(lp, 0.0))
    finite = np.isfinite(d)
    keep = finite & (s_up >= S_MIN)
    return {
        "median": float(np.median(d[keep] / s_up[keep])) if keep.any() else None,
        "n": int(keep.sum()) * step,
        "abs_median": float(np.median(d[finite])) if finite.any() else None,
        "abs_n": int(finite.sum()) * step,
    }


def infer_pair(rows: dict[str, tuple[dict | None, str]], observed: dict | None) -> str | None:
    """The dtype pair whose floor the observed errors fit best: nearest in log space to the pair's median
    logit error (floored at a tenth of its 99th percentile: zoo:jamba's float32 median is 0) from at least
    INFER_MIN_TOKENS unsure tokens, else to the pair's median |d| over every token from as many tokens (ties,
    as float32 and float16 have there, go to the stricter pair); None with fewer. The measured medians lie
    10x (bfloat16 vs float16) to 600x (float16 vs float32) apart in logit error and 100x (bfloat16 vs the
    others) in |d|, wider than one model's spread over prompts."""
    if not observed:
        return None
    if observed.get("median") is not None and observed.get("n", 0) >= INFER_MIN_TOKENS:
        seen, field = observed["median"], "token"
    elif observed.get("abs_median") is not None and observed.get("abs_n", 0) >= INFER_MIN_TOKENS:
        seen, field = observed["abs_median"], "token_abs_diff"
    else:
        return None
    at = np.log(max(float(seen), MIN_UNIT))

    def distance(pair: str) -> float:
        stats = (rows[pair][0] or {}).get(field) or {}
        if field == "token":
            if stats.get("q99") is None:
                return np.inf
            typical = max(float(stats.get("median") or 0.0), 0.1 * float(stats["q99"]))
        else:
            if stats.get("median") is None:
                return np.inf
            typical = float(stats["median"])
        # to 0.1%: medians a float32 ulp apart (float32's and float16's median |d|, 4.768e-7) are a tie
        return round(abs(at - np.log(max(typical, MIN_UNIT))), 3)

    def strictness(pair: str) -> float:
        return float(((rows[pair][0] or {}).get("token") or {}).get("q99") or np.inf)

    best = min(rows, key=lambda pair: (distance(pair), strictness(pair)))
    return best if np.isfinite(distance(best)) else None


def server_pair(engine_dtype: str | None, reference_dtype: str | None, kind: str) -> str | None:
    """The table's key for an engine judged by a server reference (`kind` in SERVER_REFERENCES): the engine's
    dtype against the reference's, which is the engine's own when not stated (a self-reference is the engine;
    a trusted deployment of the same model runs as the engine does unless told otherwise)."""
    reference_dtype = reference_dtype or engine_dtype
    if not engine_dtype or not reference_dtype:
        return None
    return f"{engine_dtype}/{reference_dtype} ref={kind}"


def _server_floor(table, engine_dtype, reference_dtype, kind, model) -> dict | None:
    """The floor of an engine against a server reference: the pair measured for that kind of reference
    (the engine's decode against a prefill of the same tokens), else the engine dtype's pair against float32
    transformers, said (two deployments of one dtype differ by less than that dtype does from float32)."""
    against = SERVER_REFERENCES[kind]
    pair = server_pair(engine_dtype, reference_dtype, kind)
    if pair is None:
        # the reference's own dtype, when it has one (vLLM's offline reference): only the pairs measured against it
        against_dtype = f"/{reference_dtype} ref={kind}" if reference_dtype else f" ref={kind}"
        known = [p for p in (table.get("pairs") or {}) if p.endswith(f" ref={kind}") and against_dtype in p]
        if not known:
            return None
        rows = {p: _row(table, p, model) for p in known}
        pair = _most_lenient(rows)
        floor = envelope(rows[pair][0])
        floor.update(
            source="table",
            pair=pair,
            assumed_dtype=pair.split("/")[0],
            detail=f"the shipped table: the engine's dtype is not recorded, so the most lenient pair measured "
            f"against {against}, {pair} ({rows[pair][1]}); declare -E dtype=... to judge against another",
        )
        return floor
    row, how = _row(table, pair, model)
    if row is not None:
        floor = envelope(row)
        floor.update(
            source="table", pair=pair, detail=f"the shipped table, {pair} (the engine against {against}), {how}"
        )
        return floor
    fallback = f"{engine_dtype}/float32"
    row, how = _row(table, fallback, model)
    if row is None:
        return None
    floor = envelope(row)
    floor.update(
        source="table",
        pair=fallback,
        detail=f"the shipped table has no floor for {pair} (the engine against {against}): judged with "
        f"{fallback}'s, the engine's dtype against float32 transformers ({how})",
    )
    return floor


def run_floor(
    table: dict, run_info: dict, calibration: dict | None = None, observed: dict | None = None, engine_dtype=None
) -> dict | None:
    """`expected_floor` with a run's facts (`run_info`: engine_dtype, reference_dtype, reference_kind, model,
    configuration, kv_seen); `engine_dtype` when a calibration run names the engine's dtype instead."""
    return expected_floor(
        table,
        engine_dtype or run_info.get("engine_dtype"),
        run_info.get("reference_dtype"),
        run_info.get("model"),
        calibration,
        observed=observed,
        configuration=run_info.get("configuration"),
        reference_kind=run_info.get("reference_kind"),
        kv_seen=run_info.get("kv_seen"),
    )


# a float32 engine whose K/V are rounded to float16 on the way to attention, when the server does not say so
F16_COPY_WHY = "an f16 KV copy (flash attention over an f32 KV cache, or an f16 KV cache)"
F16_COPY_ADVICE = (
    "inferred from its errors, not declared (the server does not say its KV cache): declare it with "
    "--kv-cache-dtype float16; for exact float32, an f32 KV cache without flash attention (llama-server -fa off; "
    "llama-cpp-python's server --type_k 0 --type_v 0)"
)


def _fits_f16_copy(plain: dict | None, f16: dict | None, observed: dict | None) -> bool:
    """The observed top-k spread's 99th percentile is nearer, in log space, to the `kv=float16` row's than to
    the plain row's (a tie stays plain: the stricter floor)."""

    def q99(row):
        return float(((row or {}).get("topk") or {}).get("q99") or 0.0)

    if not observed or q99(plain) <= 0 or q99(f16) <= 0:
        return False
    at = np.log(max(observed["topk_q99"], 1e-30))
    return abs(at - np.log(q99(f16))) < abs(at - np.log(q99(plain)))


def _f16_copy(table: dict, pair: str, row: dict | None, how: str, model: str | None, kv_seen: dict | None):
    """(pair, row, how, configured): a float32 engine that does not say its KV cache (`kv_seen`: its top-k
    spread, `kv_signature.seen`) is judged by the `kv=float16` row when its spread sits nearer that row than
    float32's own (`_fits_f16_copy`), the configuration named as inferred; else as it was."""
    if kv_seen is None or row is None or pair != "float32/float32":
        return pair, row, how, None
    keyed = f"{pair} kv=float16"
    alt, how_alt = _row(table, keyed, model)
    if alt is None or not _fits_f16_copy(row, alt, kv_seen):
        return pair, row, how, None
    how_alt += (
        f"; its top-k spread (99th percentile {kv_seen['topk_q99']:.2g} over {kv_seen['n']} positions) sits "
        "nearer that row than float32's own"
    )
    return keyed, alt, how_alt, {"kv": "float16", "why": F16_COPY_WHY, "inferred": F16_COPY_ADVICE}


def infers_dtype(table: dict, run_info: dict, engine_dtype=None) -> bool:
    """Whether the run's floor waits for its token errors (an engine dtype the table has no pair for: unknown,
    `auto`): `observed_logit_error` of the run then picks the pair. Never against a server reference, whose
    token errors are the engine against itself, not against float32."""
    if run_info.get("reference_kind") in SERVER_REFERENCES or not run_info.get("reference_dtype"):
        return False
    pair = f"{engine_dtype or run_info.get('engine_dtype')}/{run_info.get('reference_dtype')}"
    return pair not in (table.get("pairs") or {})


def expected_floor(
    table: dict,
    engine_dtype: str | None,
    reference_dtype: str | None,
    model: str | None = None,
    calibration: dict | None = None,
    observed: dict | None = None,
    configuration: dict | None = None,
    reference_kind: str | None = None,
    kv_seen: dict | None = None,
) -> dict | None:
    if reference_kind in SERVER_REFERENCES:
        floor = _server_floor(table, engine_dtype, reference_dtype, reference_kind, model)
        if floor is None:
            return None
        return _finish(table, floor, model, reference_dtype or engine_dtype)
    if not reference_dtype:
        return None
    same, how_same = _row(table, f"{reference_dtype}/{reference_dtype}", model)
    if calibration is not None and calibration.get("token", {}).get("median") is not None:
        floor = envelope(calibration, same)
        floor.update(
            source="calibration-run",
            pair=f"{engine_dtype}/{reference_dtype}",
            detail=f"a calibration run (the reference at {engine_dtype}), at least the table's "
            f"{reference_dtype}/{reference_dtype} floor ({how_same})",
        )
    else:
        pair = f"{engine_dtype}/{reference_dtype}"
        row, how = _row(table, pair, model)
        unmeasured = ""
        if configuration and row is not None:  # the engine's configuration moves its floor: that row, when measured
            keyed = f"{pair} kv={configuration['kv']}"
            configured, how_configured = _row(table, keyed, model)
            if configured is not None:
                pair, row, how = keyed, configured, how_configured
            else:
                unmeasured = f"; {configuration['why']} has no measured floor: judged as {pair}"
        elif not configuration:
            pair, row, how, configuration = _f16_copy(table, pair, row, how, model, kv_seen)
        if row is not None:
            floor = envelope(row, same)
            floor.update(source="table", pair=pair, detail=f"the shipped table, {pair}, {how}{unmeasured}")
            if configuration and pair.endswith(f" kv={configuration['kv']}"):
                floor["configured"] = dict(configuration)
        else:
            known = [p for p in (table.get("pairs") or {}) if p.endswith(f"/{reference_dtype}")]
            if not known:
                return None
            rows = {p: _row(table, p, model) for p in known}
            inferred = infer_pair(rows, observed)
            f16_copy = f"float32/{reference_dtype} kv=float16"
            if kv_seen is not None and f16_copy in (table.get("pairs") or {}):  # its KV unsaid: a candidate too
                inferred = infer_pair({**rows, f16_copy: _row(table, f16_copy, model)}, observed)
            if inferred == f16_copy:
                keyed, row, inferred_how = inferred, *_row(table, f16_copy, model)
                configured = {"kv": "float16", "why": F16_COPY_WHY, "inferred": F16_COPY_ADVICE}
            elif inferred is not None:
                keyed, row, inferred_how, configured = _f16_copy(
                    table, inferred, rows[inferred][0], rows[inferred][1], model, kv_seen
                )
            if inferred is not None:
                floor = envelope(row, same)
                if (observed.get("n") or 0) >= INFER_MIN_TOKENS:
                    seen = f"median {observed['median']:.2g} nats of logit error over {observed['n']} unsure tokens"
                else:
                    seen = f"median |d| {observed['abs_median']:.2g} over {observed['abs_n']} tokens"
                floor.update(
                    source="table",
                    pair=keyed,
                    assumed_dtype=inferred.split("/")[0],
                    inferred_dtype=inferred.split("/")[0],
                    detail=f"the shipped table: the engine's dtype is {engine_dtype or 'not recorded'}, and its "
                    f"token errors ({seen}) fit {inferred} best, so "
                    + (f"{keyed}'s floor ({inferred_how})" if configured else f"its floor ({inferred_how})")
                    + "; declare -E dtype=... to judge against another",
                )
                if configured:
                    floor["configured"] = configured
            else:
                lenient = _most_lenient(rows)
                floor = envelope(rows[lenient][0], same)
                floor.update(
                    source="table",
                    pair=lenient,
                    assumed_dtype=lenient.split("/")[0],
                    detail=f"the shipped table: the engine's dtype is {engine_dtype or 'not recorded'}, so the "
                    f"most lenient pair measured, {lenient} ({rows[lenient][1]})",
                )
    return _finish(table, floor, model, reference_dtype)


def _finish(table: dict, floor: dict, model: str | None, reference_dtype: str | None) -> dict:
    """The tie margin, honest departures and measured settings of the floor's pair."""
    floor["tie_margin"] = tie_margin(floor)
    honest = _honest(table, floor["pair"], model)
    if honest:
        floor["honest"] = honest
    # what the row was measured over (prompts, knob settings), where the table says: a floor far above it
    # on other settings is said with them
    every = table.get("settings") or {}
    settings = (every.get(floor["pair"]) or every.get(f"{reference_dtype}/{reference_dtype}") or {}).get(model or "")
    if settings:
        floor["settings"] = settings
    return floor
