"""Small torch helpers shared by the HF engine and the reference rescorer (imports torch)."""

from __future__ import annotations

import os

import torch

from lpf.core.errors import LpfError, did_you_mean


def quiet_transformers() -> None:
    """No hub access (there is none to have) and no per-load progress bars or kernel-fallback chatter:
    lpf draws its own progress, and the pure-PyTorch Mamba fallback on CPU is expected."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def shape_stable_attention():
    """A context in which `F.scaled_dot_product_attention` never picks cuDNN's kernel. cuDNN's attention
    plans a graph for every new (batch, length) shape, milliseconds of host time each, and a rescorer or a
    continuous-batching engine meets a new shape at nearly every call: on an H200 (2026-12-04) 208 cuDNN
    attention calls of the rescorer's 1.24B Llama cost 923 ms of host time for 22 ms on the GPU, and the
    built-in engine, which gets cuDNN only in bfloat16 (it has no float32 kernel), ran zoo:stress 8x slower
    in bfloat16 than in float32. Flash and memory-efficient attention have no per-shape plan. No effect on
    a CPU, which has no cuDNN attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise LpfError(f"unknown dtype {name!r}{did_you_mean(name, DTYPES)}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def max_context(config) -> int | None:
    """The longest sequence the model was configured for, when the config says."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# Column groups for the exact top-k: [N, V] is viewed as [N, G, V // G] and the max of each column is
# taken (one vectorised pass); the k best columns hold the k best values (each column the top-k
# misses is beaten by k column maxima), so the final top-k runs over k * G candidates instead of V.
_TOPK_GROUPS = 32
# exp(y) is 0 in float32 for y < -104: clamping there changes no probability, and keeps 0 * -inf
# (a -inf logit, e.g. a top-k-masked one) out of the entropy sum without a host check (GPU).
_ENTROPY_FLOOR = -1.0e4
# On a CPU the passes run over blocks of rows that stay in a core's L2 cache (~1 MiB of logits):
# each row is then read from memory once instead of once per pass. Per-op overhead bounds it below.
_CPU_BLOCK_BYTES = 1 << 20


def row_block(n: int, v: int, device: torch.device | str) -> int:
    """Rows that logprob_rows processes per pass on `device` (its scratch needs block * v floats)."""
    return n if torch.device(device).type == "cuda" else max(1, min(n, _CPU_BLOCK_BYTES // (4 * v)))


def topk_rows(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k values and ids of each row of z [N, V], sorted descending (ties in any order)."""
    n, v = z.shape
    cols = v // _TOPK_GROUPS
    if cols < 4 * k:
        return z.topk(k, dim=-1)
    main = cols * _TOPK_GROUPS
    best = z[:, :main].view(n, _TOPK_GROUPS, cols).amax(1).topk(k, dim=-1).indices  # [N, k] columns
    cand = (best.unsqueeze(2) + torch.arange(0, main, cols, device=z.device)).view(n, -1)
    if main < v:  # the last v % G ids belong to no column: always candidates
        cand = torch.cat([cand, torch.arange(main, v, device=z.device).expand(n, -1)], dim=1)
    top_z, at = z.gather(1, cand).topk(k, dim=-1)
    return top_z, cand.gather(1, at)


def logprob_rows(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
    overwrite: bool = False,
    fused: bool = False,
):
    """For rows of logits [N, V] and chosen tokens [N]: float32 logprobs of the tokens, the top
    max(k, 1) ids and logprobs (column 0 is the argmax), ranks (1 = argmax), entropies.

    This is the hot loop of rescoring: it allocates nothing of size [N, V] beyond one work buffer
    (`scratch`, float32, reused by the caller across calls when given) and, with `overwrite` (the
    caller's float32 logits are scratch too), writes the exps over the logits. Passes: column maxima
    (the top-k), `z > z_token` (the rank: the token's place among all V; on a CPU only for rows whose
    token is outside the top-k), y = z - max, e = exp(y), S = sum(e), sum(e * y); then
    lse = max + log S and entropy = log S - sum(e * y) / S. On a GPU all rows at once and no host
    synchronisation (results stay on the device); on a CPU in L2-sized blocks of rows.
    `fused` (a GPU): S, sum(e * y) and the rank's count in one compiled kernel that reads the logits once
    (`row_sums`) instead of seven elementwise and reduction passes; the same float32 arithmetic up to the
    order of the sums.
    """
    z = logits.float()
    owned = overwrite or z.data_ptr() != logits.data_ptr()
    n, v = z.shape
    token_ids = token_ids.view(-1).to(z.device)
    block = row_block(n, v, z.device)
    if (
        scratch is not None
        and scratch.dtype == torch.float32
        and scratch.device == z.device
        and scratch.numel() >= block * v
    ):
        work = scratch.view(-1)
    else:
        work = torch.empty(block * v, device=z.device)
    if not owned:
        exps = torch.empty(block * v, device=z.device)
    outs = []
    for i in range(0, n, block):
        zb = z[i : i + block]
        b = zb.shape[0]
        outs.append(
            _rows(
                zb,
                token_ids[i : i + block],
                max(k, 1),
                work[: b * v].view(b, v),
                zb if owned else exps[: b * v].view(b, v),
                fused,
            )
        )
    if len(outs) == 1:
        return outs[0]
    return tuple(torch.cat([o[j] for o in outs]) for j in range(5))


def _row_sums(z: torch.Tensor, z_tok: torch.Tensor, m: torch.Tensor):
    """Per row of z [n, V]: S = sum(exp(y)), sum(exp(y) * y) with y = max(z - m, floor), and the count of
    logits above z_tok: three reductions over the same rows, which a compiler fuses into one read of z."""
    y = (z - m).clamp_min(_ENTROPY_FLOOR)
    e = torch.exp(y)
    return e.sum(1), (e * y).sum(1), (z > z_tok).sum(1)


_ROW_SUMS: dict = {}  # "fn": the compiled _row_sums, or "failed": why compiling it did not work


def row_sums(z: torch.Tensor, z_tok: torch.Tensor, m: torch.Tensor):
    """`_row_sums` compiled once (torch.compile, dynamic in the row count); where compiling or running the
    compiled kernel fails (no Triton, no compiler), the same ops eagerly, and `_ROW_SUMS["failed"]` says why."""
    if "failed" not in _ROW_SUMS:
        try:
            if "fn" not in _ROW_SUMS:
                _ROW_SUMS["fn"] = torch.compile(_row_sums, dynamic=True, fullgraph=True)
            return _ROW_SUMS["fn"](z, z_tok, m)
        except Exception as e:  # noqa: BLE001 - any compiler failure falls back to the eager ops
            _ROW_SUMS["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return _row_sums(z, z_tok, m)


def _rows(
    z: torch.Tensor, token_ids: torch.Tensor, k: int, work: torch.Tensor, exps: torch.Tensor, fused: bool = False
):
    """logprob_rows on one block; `work` and `exps` ([b, V] float32) may be written, `exps` may be z."""
    top_z, top_ids = topk_rows(z, k)
    z_tok = z.gather(1, token_ids.view(-1, 1))
    m = top_z[:, :1]
    if fused:
        s, d, above = row_sums(z, z_tok, m)
        log_s = torch.log(s)
        lse = m.squeeze(1) + log_s
        entropy = log_s - d / s
        return z_tok.squeeze(1) - lse, top_ids, top_z - lse.unsqueeze(1), above.to(torch.int64) + 1, entropy
    rank = (top_z > z_tok).sum(1) + 1
    if z.is_cuda:  # a bool mask (1 byte an entry, a vectorised kernel) rather than float32 through `work`
        rank = torch.gt(z, z_tok).sum(1) + 1
    elif bool((z_tok < top_z[:, -1:]).any()):  # on a CPU the check costs no synchronisation
        rank = torch.gt(z, z_tok, out=work).sum(1).to(torch.int64) + 1  # counted in float32: exact, V < 2^24
    y = torch.sub(z, m, out=work)
    if z.is_cuda:
        y.clamp_(min=_ENTROPY_FLOOR)
    e = torch.exp(y, out=exps)
    s = e.sum(1)
    d = torch.mul(e, y, out=e).sum(1)
    if not z.is_cuda:
        bad = d.isnan()
        if bool(bad.any()):  # -inf logits: 0 * -inf terms are 0 (NaN logits stay NaN through s)
            d[bad] = torch.nan_to_num(torch.exp(y[bad]) * y[bad], nan=0.0).sum(1)
    log_s = torch.log(s)
    lse = m.squeeze(1) + log_s
    entropy = log_s - d / s
    return z_tok.squeeze(1) - lse, top_ids, top_z - lse.unsqueeze(1), rank, entropy
