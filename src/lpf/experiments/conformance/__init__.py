"""`lpf conformance`: every hybrid architecture an engine claims, under a grid of knobs, each cell
audited (outputs and prompt positions) and every non-clean cell attributed with `lpf diff`.

  discover.py     which architectures both the engine and the installed transformers can load
                  (vLLM's own registry asked in vLLM's interpreter by vllm_probe.py), and why not
  tiny.py         a tiny checkpoint of each architecture from its own default config, scaled down
  grid.py         the knob cells (small: CI; full: the documented matrix) and the shared workload
  plan.py         every architecture x cell as an AuditSpec before anything runs, the engine's base
                  knobs by role (a short context, prefix caching off)
  matrix.py       running the cells, the HF generate attribution, conformance.json
"""
