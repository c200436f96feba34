"""vLLM CPU: does the speculative Gated DeltaNet SSM op share bug 26's short-row problem? (Measured: no.)

Run: .venv-vllm/bin/python scripts/repro/cpu_gdn_spec_ssm_short_rows.py   (no engine started; exit 1: a row wrong)
Bug 26 is the conv half of the CPU spec path (`_spec_forward`, `layers/mamba/ops/cpu/gdn_attention.py:510-555`):
a right-aligned rolling buffer that only rows of 1 + K tokens read right. The SSM half (:560-582) is one C++ op,
`fused_sigmoid_gating_delta_rule_update_spec_cpu`, given the same per-row `num_accepted_tokens`, the
[rows, 1 + K] slot table and `cu_seqlens`. The GPU kernel it stands in for
(`third_party/flash_linear_attention/ops/fused_sigmoid_gating.py`) starts a row from slot column
`num_accepted - 1` and stores the state after its token t in slot column t, whatever the row's length.
Here: that contract in torch (float32, the CPU state layout [slots, heads, k, v] of `_ssm_state_view`, :373-376)
against the op, on full rows, short rows (no drafts: 1 token) and batches mixing both with different accepted
counts; outputs and every written slot compared. The op's inputs are bfloat16 (it refuses float32).
"""

import sys

import torch
import torch.nn.functional as F

import vllm._custom_ops as ops

torch.manual_seed(0)
H, HV, K, V, SLOTS = 2, 4, 32, 32, 16  # 2 key heads serving 4 value heads, as Qwen3.5's GDN


def bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


A_log, dt_bias = bf(torch.randn(HV) * 0.5 - 1).float(), bf(torch.randn(HV) * 0.3).float()


def contract(state, slots, accepted, cu, q, k, v, a, b):
    """The GPU kernel's semantics: start at column accepted - 1, store the state after token t in column t."""
    state, outs = state.clone(), []
    for i in range(len(accepted)):
        h = state[int(slots[i, int(accepted[i]) - 1])].clone()  # [HV, K, V]
        for t in range(int(cu[i]), int(cu[i + 1])):
            qt, kt = (F.normalize(x[t].repeat_interleave(HV // H, 0), dim=-1, eps=1e-6) for x in (q, k))
            g = -A_log.exp() * F.softplus(a[t] + dt_bias)
            h = h * g.exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", h, kt)) * torch.sigmoid(b[t])[:, None]
            h = h + kt[:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", h, qt * K**-0.5))
            state[int(slots[i, t - int(cu[i])])] = h
    return torch.stack(outs), state


def check(lens: list[int], accepted: list[int]) -> float:
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k = bf(torch.randn(n, H, K)).float(), bf(torch.randn(n, H, K)).float()
    v, a, b = (bf(x).float() for x in (torch.randn(n, HV, V), torch.randn(n, HV), torch.randn(n, HV)))
    slots = torch.arange(1, 1 + 4 * len(lens), dtype=torch.int32).view(len(lens), 4)  # K = 3: 1 + K columns
    state = torch.randn(SLOTS, HV, K, V) * 0.3
    want_out, want_state = contract(state, slots, torch.tensor(accepted), cu, q, k, v, a, b)
    got_state = state.clone()
    got = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=bf(A_log), dt_bias=bf(dt_bias), q=bf(q), k=bf(k), v=bf(v), a=bf(a), b=bf(b),
        initial_state_source=got_state, spec_state_indices=slots,
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32), cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
    ).float().reshape(want_out.shape)  # fmt: skip
    out_err = float((got - want_out).abs().max())
    state_err = float((got_state - want_state).abs().max())
    print(f"rows of {lens} tokens, accepted {accepted}: max |out - contract| {out_err:.2g}, states {state_err:.2g}")
    return max(out_err, state_err)


worst = max(
    check([4], [1]),
    check([4], [3]),
    check([1], [1]),
    check([1], [3]),
    check([1, 4], [1, 2]),
    check([4, 1, 2], [4, 2, 1]),
    check([1, 1], [1, 3]),
)
# the op's outputs are bfloat16 (~3 significant digits); a wrong start column or slot is off by O(1)
bad = worst > 0.02
print("reproduced: a row read or wrote the wrong state" if bad else "not reproduced: every row follows the contract")
sys.exit(1 if bad else 0)
