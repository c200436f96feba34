"""vLLM CPU: RotaryEmbedding.forward_cpu on [tokens, heads, head_size] queries/keys (the layout Lfm2 and
Lfm2Moe pass, after their per-head q/k layernorm) rotates with the wrong positions; on the flat
[tokens, heads * head_size] layout every other model passes, it matches forward_native.

Run: .venv-vllm/bin/python scripts/repro/cpu_rotary_3d.py      (no model, no engine: ~5 s)
"""

import torch

from _tiny import versions

if __name__ == "__main__":
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    print(versions())
    T, heads, kv_heads, hd = 8, 4, 2, 32
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            hd,
            max_position=512,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
            is_neox_style=True,
            dtype=torch.float32,
        )
    torch.manual_seed(0)
    q, k = torch.randn(T, heads, hd), torch.randn(T, kv_heads, hd)
    pos = torch.arange(T)
    want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
    for name, (qq, kk) in {
        "3-D [T, heads, head_size]": (q.clone(), k.clone()),
        "flat [T, heads * head_size]": (q.clone().view(T, -1), k.clone().view(T, -1)),
    }.items():
        got_q, got_k = rope.forward_cpu(pos, qq, kk)
        dq = (got_q.view(T, heads, hd) - want_q.view(T, heads, hd)).abs().amax(-1)
        dk = (got_k.view(T, kv_heads, hd) - want_k.view(T, kv_heads, hd)).abs().amax(-1)
        print(
            f"{name}: max |forward_cpu - forward_native| q {dq.max():.2e}, k {dk.max():.2e}; "
            f"q per head at position 0: {[f'{x:.1e}' for x in dq[0].tolist()]}"
        )
    # what the 3-D call computed instead: the flattened [T * heads, head_size] rows, row r rotated as
    # position r (only the first T rows; the others left as they were)
    rows = q.clone().reshape(T * heads, 1, hd)
    rot, _ = rope.forward_native(torch.arange(T), rows[:T].clone().view(T, hd), None)
    guess = torch.cat([rot.view(T, hd), rows[T:].view(-1, hd)]).view(T, heads, hd)
    got, _ = rope.forward_cpu(pos, q.clone(), k.clone())
    print(
        f"3-D call == 'row r of the flat [T*heads, head_size] view rotated as position r, rows >= T untouched': "
        f"max |d| {(got - guess).abs().max():.2e}"
    )
