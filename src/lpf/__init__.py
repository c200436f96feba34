"""logprob-forensics: re-score an inference engine's exact tokens with a reference model and find the lies.

Where things are (imports run down this list: a package never imports one above it, but core resolves
`zoo:` specs through zoo/registry, lazily):
  cli/          the command line: one module per command group, `common` + `render` shared
                (__main__: `python -m lpf`, the same command line)
  experiments/  many audits and what they show: cells (a spec in its own process), sweep, repeat,
                shrink/, conformance/; handed AuditSpecs, never argv
  locate/       `lpf locate`: one request replayed with per-op capture, aligned op by op against the
                reference (and the reference against itself): the first op that departs, whose fault
  views/        reading finished directories for people: query (SQL), inspect (one request), diff (two runs)
  serve/        `lpf serve`: HTTP over the built-in engine    rl/   RL rollout-vs-trainer dumps, rl simulate
  report/       report.html for every directory kind
  pipeline/     spec (AuditSpec: everything one audit needs), the stages run -> rescore -> calibrate ->
                analyze over a run directory, and the reference (the teacher-forced HF rescorer)
  adapters/     the engines under test behind one interface: builtin, hf, vllm, openai, sglang
  builtin/      the built-in engine itself (scheduler, caches, runner, drills, its model implementations)
  analysis/     pure functions over Arrow tables: metrics, verdicts, shape, hypotheses, findings
  run/          the run directory: schema, crash-safe store
  zoo/          bundled trained checkpoints, the tokenizer, task generators and workloads
  core/         foundations: errors, sampling, workload, model_specs, knobs (roles on Options fields),
                devices, torch_utils, jsonsafe
Importing `lpf` is cheap: no torch, no transformers. Heavy modules load when a command needs them.
"""

__version__ = "0.1.0"
