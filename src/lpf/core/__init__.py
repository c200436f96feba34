"""Foundations every other package stands on. Nothing here imports another lpf package but the zoo's
registry, lazily, where a `zoo:` model or workload spec is resolved.

  errors.py       LpfError (the one user-facing exception) and did_you_mean
  jsonsafe.py     finite(): JSON without inf/NaN
  sampling.py     SamplingParams of a run, the per-request seed
  workload.py     prompts (JSONL or zoo:) -> EngineRequests, the normalized workload.jsonl
  model_specs.py  model specs (dir, zoo:NAME, tiny:NAME) -> local HF directories, tokenizers, tiny builds
  knobs.py        engine knobs declared as Options fields (`knob`): help, roles, shrink order, CLI flags
  devices.py      cpu | cuda | auto for the reference, and loading a model onto it (imports torch)
  torch_utils.py  dtypes, logprob_rows (the fused logprob passes) (imports torch)
The package itself imports nothing: `lpf --help` pays only for the modules a command names.
"""
