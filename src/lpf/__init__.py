"""logprob-forensics: re-score an inference engine's exact tokens with a reference model and find the lies.

Where things are (data flows down this list):
  cli/         the command line: one module per command group, `common` + `render` shared
  workload     prompts (JSONL or zoo:) -> engine requests     sampling   the run's sampling parameters
  model_specs  model specs (dir, zoo:NAME, tiny:NAME) -> local HF directories, tokenizers, tiny builds
  adapters/    the engines under test behind one interface: builtin, hf, vllm, openai, sglang
  builtin/     the built-in engine itself (scheduler, caches, runner, drills, its model implementations)
  pipeline     the stages run -> rescore -> calibrate -> analyze over a run directory
  reference    the teacher-forced HF rescorer                 run/       the run directory: schema, store
  analysis/    pure functions over Arrow tables: metrics, verdicts, shape, hypotheses, findings
  report/      report.html                                    serve/     `lpf serve` (HTTP over builtin/)
  rl/          RL rollout-vs-trainer dumps                    sweep, repeat, inspect_request, query
  zoo/         bundled trained checkpoints, the tokenizer, task generators and workloads
Importing `lpf` is cheap: no torch, no transformers. Heavy modules load when a command needs them.
"""

__version__ = "0.1.0"
