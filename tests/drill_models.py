"""Models built for drills: where a mechanism has to bite for the forensics to be judged.

`long_memory_jamba(out)` is tiny:jamba (the seed's architecture: Mamba1 + attention + MoE, random
init 0.25) with two changes made to its weights, everything else identical:
- slow SSM decay: every Mamba layer's A = -0.002 (A_log = log 0.002), so with dt ~ 0.7 the state
  keeps ~93% of itself over a 50-token prompt. In tiny:jamba (A = -1..-16) and in the trained zoo
  models a stale state read for the first prompt token has decayed away by the end of the prompt,
  so stale-state imposters there are mostly indistinguishable from clean requests (the gap in
  issue #4); a model whose state carries long memory is where the seed's bug showed.
- a sharper LM head (x4): a random model's next-token distributions are flat-ish (top-1 p ~0.3),
  and "confident gibberish" needs a confident engine.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

A = 0.002
HEAD_SCALE = 4.0


def long_memory_jamba(out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    from lpf.models import resolve_model

    if (out / "config.json").is_file():
        return out
    src = resolve_model("tiny:jamba").path
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    w = load_file(tmp / "model.safetensors")
    for k in w:
        if k.endswith("mamba.A_log"):
            w[k] = w[k].new_full(w[k].shape, math.log(A))
        elif k == "lm_head.weight":
            w[k] = w[k] * HEAD_SCALE
    save_file(w, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out
