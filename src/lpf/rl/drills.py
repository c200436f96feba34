"""The RL-cause drills of `lpf rl simulate`: one real mechanism per named cause of rollout/trainer mismatch.

Pure Python (no torch): the command line and `SimSpec` validate drills before anything loads.

  processed-logprobs[:TOP_P]  rollouts sampled at top-p TOP_P (default 0.9) and their logprobs taken
                              after the top-p filter (vLLM's logprobs_mode=processed_logprobs), while
                              the trainer scores the full distribution: every token's rollout logprob
                              is raised by -log(kept mass)
  micro-batch                 the trainer's LM-head reduction is split into as many pieces as its
                              micro-batch has sequences, each partial logit rounded to bfloat16 (a GEMM
                              whose split-K follows the batch shape); a micro-batch of one is exact
  state-dtype[:DTYPE]         the rollout engine keeps its SSM state in DTYPE between steps (default
                              bfloat16: vLLM's mamba_ssm_cache_dtype), so the state path's error
                              compounds with every decoded position
  stale-policy[:LAG]          the policy changes every step (simulated training, `--policy-drift`) and
                              the rollout engine receives the weights LAG steps late (default 1: async RL)

`CAUSE_OF` maps each drill to the cause `lpf.rl.causes` must attribute its mass to; the simulator
writes the per-token ground truth of every cause to `<stem>.causes.parquet`, which analysis never reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from lpf.core.errors import LpfError, did_you_mean
from lpf.rl import RL_DRILLS

CAUSE_OF = {
    "processed-logprobs": "processed_logprobs",
    "micro-batch": "batch_shape",
    "state-dtype": "position_growth",
    "stale-policy": "stale_weights",
}
STATE_DTYPES = ("bfloat16", "float16")
DEFAULT_DRIFT = 0.002  # relative weight change per step when stale-policy needs a moving policy
assert set(CAUSE_OF) == set(RL_DRILLS), "lpf.rl.RL_DRILLS (the command line's list) must name every drill"


@dataclass(frozen=True)
class RLDrills:
    top_p: float | None = None  # processed-logprobs
    micro_batch: bool = False
    state_dtype: str | None = None
    stale_lag: int | None = None

    @classmethod
    def parse(cls, specs) -> "RLDrills":
        if isinstance(specs, str):
            specs = [s for s in specs.split(",") if s.strip()]
        kw: dict = {}
        for spec in specs or ():
            name, _, arg = spec.strip().partition(":")
            if name not in RL_DRILLS:
                raise LpfError(
                    f"unknown RL drill {name!r}{did_you_mean(name, RL_DRILLS)}; drills: {', '.join(RL_DRILLS)}"
                )
            if name == "processed-logprobs":
                kw["top_p"] = _number(name, arg, 0.9, float, 0.01, 0.999)
            elif name == "micro-batch":
                if arg:
                    raise LpfError("RL drill micro-batch takes no argument")
                kw["micro_batch"] = True
            elif name == "state-dtype":
                dtype = arg or "bfloat16"
                if dtype not in STATE_DTYPES:
                    raise LpfError(
                        f"RL drill state-dtype: DTYPE must be one of {', '.join(STATE_DTYPES)}, got {dtype!r}"
                    )
                kw["state_dtype"] = dtype
            else:
                kw["stale_lag"] = _number(name, arg, 1, int, 1, 4)
        return cls(**kw)

    def names(self) -> list[str]:
        out = []
        if self.top_p is not None:
            out.append(f"processed-logprobs:{self.top_p:g}")
        if self.micro_batch:
            out.append("micro-batch")
        if self.state_dtype is not None:
            out.append(f"state-dtype:{self.state_dtype}")
        if self.stale_lag is not None:
            out.append(f"stale-policy:{self.stale_lag}")
        return out

    def causes(self) -> list[str]:
        return [CAUSE_OF[n.partition(":")[0]] for n in self.names()]


def _number(name: str, arg: str, default, kind, lo, hi):
    try:
        value = kind(arg) if arg else default
    except ValueError:
        raise LpfError(
            f"RL drill {name}: argument must be {'an integer' if kind is int else 'a number'}, got {arg!r}"
        ) from None
    if not lo <= value <= hi:
        raise LpfError(f"RL drill {name}: argument must be in {lo:g}..{hi:g}, got {value:g}")
    return value
