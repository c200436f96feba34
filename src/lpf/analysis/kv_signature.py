"""Flash attention's signature when an engine does not say its KV cache: the top-k spread of an f16 copy of K/V.

A float32 engine whose attention reads K and V rounded to float16 (llama.cpp's flash attention over an f32 KV
cache: docs/bugs.md 18; or an f16 KV cache) errs at every position by about what the `kv=float16` floor row
measured: its top-k spread (`token_evidence.topk_spread`'s w, which a shift of the reported logprobs does not
move, so a server that lowers its logprobs cannot fake or hide it) lies ~1000x above float32's own and, where
the model is sure of its tokens, shows where the token's own logprob error does not. A server whose
configuration is unknown (an OpenAI-compatible URL that names neither its KV cache type nor flash attention)
is judged against the row its spread sits nearer to.

Contract:
  spread(tokens, reference) -> np.ndarray: w per (request_id, position) both tables hold (NaN where fewer
      than two top-k ids are shared); pure, Arrow tables in.
  seen(spreads) -> {"topk_q99", "n"}: the 99th percentile of the finite spreads (a position count under
      MIN_POSITIONS: None), order-free, so the same whichever execution gathered them.
  unsaid(engine_name, block) -> bool: whether the run's engine is a server that said neither its KV cache type
      nor flash attention (only then is `seen` gathered, `lpf.pipeline.analyze`).
The choice itself is `floors`' (`_f16_copy`): the observed 99th percentile nearer, in log space, to the
`kv=float16` row's top-k q99 than to float32's own. An 8-bit KV cache sits 10x past the f16 row and stays
`different` against it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis.token_evidence import list_matrix, topk_spread

MIN_POSITIONS = 30  # as `floors.INFER_MIN_TOKENS`: fewer positions with a spread say nothing
_KEYS = ["request_id", "position"]


def spread(tokens: pa.Table, reference: pa.Table) -> np.ndarray:
    if "engine_topk_ids" not in tokens.column_names or not tokens.num_rows or not reference.num_rows:
        return np.zeros(0)
    left = tokens.select(_KEYS).append_column("_t", pa.array(np.arange(tokens.num_rows)))
    right = reference.select(_KEYS).append_column("_r", pa.array(np.arange(reference.num_rows)))
    j = left.join(right, keys=_KEYS, join_type="inner")
    if not j.num_rows:
        return np.zeros(0)
    t, r = tokens.take(j.column("_t")), reference.take(j.column("_r"))
    eng_ids, ref_ids = list_matrix(t.column("engine_topk_ids"), -1), list_matrix(r.column("ref_topk_ids"), -1)
    if eng_ids.shape[1] == 0 or ref_ids.shape[1] == 0:  # no top-k came back: no spread to see
        return np.zeros(0)
    out = topk_spread(
        eng_ids,
        list_matrix(t.column("engine_topk_logprobs"), -np.inf),
        ref_ids,
        list_matrix(r.column("ref_topk_logprobs"), -np.inf),
        details=False,
    )
    return np.asarray(out["w"], dtype=np.float64)


def seen(spreads: list[np.ndarray]) -> dict | None:
    w = np.concatenate([np.asarray(s, dtype=np.float64) for s in spreads]) if spreads else np.zeros(0)
    w = w[np.isfinite(w)]
    if w.size < MIN_POSITIONS:
        return None
    return {"topk_q99": float(np.quantile(w, 0.99)), "n": int(w.size)}


# engines lpf starts say their KV cache or compute it as their dtype; llama.cpp's unsaid defaults are assumed
# (`floors.configured_kv`): only a server reached by URL can leave it unknown
_SERVERS = ("openai", "sglang")


def unsaid(engine_name: str | None, block: dict | None) -> bool:
    """Whether the run's engine is a server that said nothing of its KV cache or flash attention (the manifest's
    `engine.configuration` block: both absent)."""
    conf = block or {}
    return engine_name in _SERVERS and all(
        (conf.get(f) or {}).get("value") is None for f in ("kv_cache_dtype", "flash_attention")
    )
