"""RL rollout/trainer mismatch: dumps (`dump`), per-step metrics (`metrics`), spikes (`spikes`),
hypotheses (`hypotheses`), findings (`analyze`), the simulated RL loop (`simulate`).
Its commands live in `lpf.cli.rl`."""
