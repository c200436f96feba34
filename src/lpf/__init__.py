"""logprob-forensics: re-score an inference engine's exact tokens with a reference model and find the lies.

Where things are (imports run down this list; a package never imports one above it):
  cli/          the command line: one module per command group, `common` + `render` shared
  experiments/  many audits and what they show: sweep, repeat, shrink/, conformance/
  views/        reading finished directories for people: query (SQL), inspect (one request), diff (two runs)
  serve/        `lpf serve`: HTTP over the built-in engine    rl/   RL rollout-vs-trainer dumps, rl simulate
  report/       report.html for every directory kind
  pipeline/     the stages run -> rescore -> calibrate -> analyze over a run directory, and the
                reference (the teacher-forced HF rescorer the rescore stage runs)
  adapters/     the engines under test behind one interface: builtin, hf, vllm, openai, sglang
  builtin/      the built-in engine itself (scheduler, caches, runner, drills, its model implementations)
  analysis/     pure functions over Arrow tables: metrics, verdicts, shape, hypotheses, findings
  run/          the run directory: schema, crash-safe store
  zoo/          bundled trained checkpoints, the tokenizer, task generators and workloads
  core/         foundations: errors, sampling, workload, model_specs, devices, torch_utils, jsonsafe
Importing `lpf` is cheap: no torch, no transformers. Heavy modules load when a command needs them.
"""

__version__ = "0.1.0"
