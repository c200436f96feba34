"""The model zoo: small trained models and oracle workloads shipped inside the package.

Contract:
- `lpf.zoo.registry`: `MODELS` and `model_dir(name)` resolve `zoo:NAME` to a bundled Hugging Face
  directory (config.json, model.safetensors, tokenizer files, README.md card, lpf_card.json);
  `tokenizer_dir()`; `list_models()`; `WORKLOADS`, `workload_items(name, seed, n)`, `list_workloads()`.
  Unknown names raise `lpf.core.errors.LpfError` with a "did you mean" suggestion.
- `lpf.zoo.tasks`: seeded, deterministic task generators with exact expected answers; items are dicts with
  `id`, `task`, `prompt` (the text before the answer), `expected` (the text before `</s>`), optional
  `max_tokens`.
- Checkpoints are made by `scripts/train_tokenizer.py` and `scripts/train_zoo.py`; tests never retrain.

Importing this package is cheap: no torch, no transformers.
"""
