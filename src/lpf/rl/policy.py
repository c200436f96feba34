"""The simulated policy of `lpf rl simulate --policy-drift`: weights that change every training step.

Contract: `PolicyDrift(model_dir, scale, seed, keys)` reads the checkpoint's safetensors once;
`weights(step)` is W_step = W_0 * (1 + scale * (N_1 + ... + N_step)) on every `keys` tensor (the
decoder's 2-D linear weights that the trainer and the engine both name the same way; embeddings, the
LM head, norms and routers stay put), each N_k a fixed standard normal draw of (seed, k, tensor): a
random walk of `scale` relative change per step, the stand-in for the optimizer's update, identical
on every run. `load_into(module, sd, rename)` copies such a dict into a live module (the engine's
model, the trainer's HF model) in place, as an RL weight sync does. `save(step, out_dir)` writes
`out_dir/step_{step}/`: the checkpoint's other files plus model.safetensors at W_step, so the trainer's
weights at every step are a Hugging Face checkpoint `lpf rl rescore --reference DIR/step_{step}` loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_SKIP = ("embed", "lm_head", "norm", "router")


def decoder_matrices(state_keys) -> list[str]:
    """The keys a drift moves: 2-D linear weights of the decoder (callers intersect with what exists)."""
    return sorted(k for k in state_keys if k.endswith(".weight") and not any(s in k for s in _SKIP))


class PolicyDrift:
    def __init__(self, model_dir: Path, scale: float, seed: int, keys):
        from safetensors.torch import load_file

        self.model_dir = Path(model_dir)
        self.scale = scale
        self.seed = seed
        base = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            base.update(load_file(str(f)))
        self.base = base
        self.keys = [
            k for k in decoder_matrices(keys) if k in base and base[k].dim() == 2 and base[k].is_floating_point()
        ]
        self._acc = {k: torch.zeros_like(base[k], dtype=torch.float32) for k in self.keys}
        self._at = 0
        self._cache: dict[int, dict[str, torch.Tensor]] = {0: {k: base[k].float().clone() for k in self.keys}}

    def weights(self, step: int) -> dict[str, torch.Tensor]:
        """W_step on the drifted keys (float32). Steps are computed in order and the last few kept."""
        if step in self._cache:
            return self._cache[step]
        if step < self._at:
            raise ValueError(f"policy step {step} is older than the kept ones ({sorted(self._cache)})")
        while self._at < step:
            self._at += 1
            for i, k in enumerate(self.keys):
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + self._at * 7_919 + i) & 0x7FFFFFFF)
                self._acc[k] += torch.randn(self._acc[k].shape, generator=g)
            self._cache[self._at] = {k: self.base[k].float() * (1.0 + self.scale * self._acc[k]) for k in self.keys}
        for old in [s for s in self._cache if s < step - 4]:
            del self._cache[old]
        return self._cache[step]

    @staticmethod
    @torch.no_grad()
    def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], rename=None) -> None:
        sd = rename(dict(weights)) if rename else weights
        params = dict(module.named_parameters())
        missing = [k for k in sd if k not in params]
        if missing:
            raise RuntimeError(f"weight sync: {len(missing)} keys the module does not have (first {missing[0]})")
        for k, v in sd.items():
            params[k].copy_(v)

    def save(self, step: int, out_dir: Path) -> Path:
        from safetensors.torch import save_file

        target = Path(out_dir) / f"step_{step}"
        target.mkdir(parents=True, exist_ok=True)
        for f in self.model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, target / f.name)
        w = self.weights(step)
        sd = {k: (w[k].to(v.dtype) if k in w else v).contiguous() for k, v in self.base.items()}
        save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
        return target
