"""RL rollout/trainer mismatch: dumps (`dump`) and the framework readers (`formats`), per-step
metrics (`metrics`), spikes (`spikes`), hypotheses (`hypotheses`), the third opinion
(`reference_scores`, `attribution`), findings (`analyze`), the simulated RL loop (`simulate`).
Its commands live in `lpf.cli.rl`. Importing this package is light (no numpy, no pyarrow): the
command line reads FORMAT_NAMES from it (the reader registry's names: `lpf.rl.readers`)."""

from lpf.rl.readers import NAMES as FORMAT_NAMES

__all__ = ["FORMAT_NAMES", "RL_DRILLS"]

RL_DRILLS = ("processed-logprobs", "micro-batch", "state-dtype", "stale-policy")  # lpf.rl.drills checks it
