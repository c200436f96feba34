"""vLLM CPU: a speculating Gated DeltaNet engine reads the wrong conv history on a row with fewer than K drafts.

Run: .venv-vllm/bin/python scripts/repro/cpu_gdn_spec_conv_short_rows.py   (no engine started; exit 1: reproduced)
With K speculative tokens the GDN conv state is a rolling buffer of width - 1 + K columns, and every decode row
of a speculating engine is a spec row, drafts or none (`v1/attention/backends/gdn_attn.py`:
`spec_sequence_masks_cpu = num_decode_draft_tokens_cpu >= 0`). The CPU spec path (`_spec_forward`,
`layers/mamba/ops/cpu/gdn_attention.py:510-555`) reads the window at column num_accepted - 1 and then keeps
`state_len - q` columns from column num_accepted on and appends the row's q new inputs: a right-aligned buffer,
which is what the next read expects only when q = 1 + K. A row with no draft (q = 1, num_accepted 1) leaves its
newest input at the buffer's end while the next step reads columns 0 .. width - 2.
Here: a prompt prefilled by the CPU prefill (`_causal_conv1d_fwd_cpu`, which writes the first width - 1 columns),
then 1-token steps through the native op with num_accepted_tokens 1 (the AMX path, :510-531) and through the
torch fallback's arithmetic (:533-555), against F.conv1d over the whole sequence; and, as the control, the same
steps on a plain width - 1 buffer without speculation.
"""

import sys

import torch
import torch.nn.functional as F

import vllm._custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _causal_conv1d_fwd_cpu, _causal_conv1d_update_cpu

torch.manual_seed(0)
D, W, T, STEPS, K = 256, 4, 10, 4, 3
w = (torch.randn(D, W) * 0.5).to(torch.bfloat16)
packed = ops.causal_conv1d_weight_pack(w.contiguous().clone())
xs = torch.randn(T + STEPS, D).to(torch.bfloat16)
ref = F.silu(F.conv1d(xs.float().t()[None], w.float()[:, None], padding=W - 1, groups=D)[0, :, : T + STEPS]).t()
SLOT = torch.tensor([1], dtype=torch.int32)


def prefilled(state_len: int) -> torch.Tensor:
    buf = torch.zeros(2, state_len, D, dtype=torch.bfloat16).transpose(-1, -2)  # SD layout, viewed (slots, dim, len)
    _causal_conv1d_fwd_cpu(
        x=xs[:T].clone().t(),
        weight=packed,
        bias=None,
        conv_states=buf,
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        cache_indices=SLOT,
        has_initial_state=torch.tensor([False]),
        silu_activation=True,
        is_weight_packed=True,
    )
    return buf


def steps(kind: str) -> list[float]:
    buf = prefilled(W - 1 + (0 if kind == "plain" else K))
    errs = []
    for s in range(STEPS):
        x1 = xs[T + s : T + s + 1].contiguous()
        if kind == "fallback":
            b = buf[1]
            prior = b[:, : W - 1]  # offset = num_accepted - 1 = 0
            out = F.silu(F.conv1d(torch.cat([prior, x1.t()], -1)[None].float(), w.float()[:, None], groups=D))[0, :, -1]
            b.copy_(torch.cat([b[:, 1 : 1 + (b.shape[-1] - 1)], x1.t()], -1))
        else:
            extra = {} if kind == "plain" else {"num_accepted_tokens": torch.tensor([1], dtype=torch.int32)}
            x = x1 if kind == "plain" else x1.view(1, 1, D)
            out = _causal_conv1d_update_cpu(
                x=x, conv_states=buf, weight=packed, bias=None, silu_activation=True, conv_state_indices=SLOT,
                is_weight_packed=True, **extra,
            )  # fmt: skip
        errs.append(float((out.float().reshape(-1) - ref[T + s]).abs().max()))
    return errs


results = {kind: steps(kind) for kind in ("plain", "native", "fallback")}
for kind, errs in results.items():
    print(f"{kind:8s} max |conv out - F.conv1d| per 1-token step: " + ", ".join(f"{e:.3g}" for e in errs))
bad = any(e > 0.5 for e in results["native"][1:])
print("reproduced: steps after the first read a stale window" if bad else "not reproduced")
sys.exit(1 if bad else 0)
