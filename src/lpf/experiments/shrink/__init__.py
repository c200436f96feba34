"""`lpf shrink`: from a failing audit to the smallest configuration that still makes a request lie.

  config.py        the source run, the target, a candidate's configuration (requests, lengths, knobs)
  signature.py     what "the same lie" means (verdict, first-divergence position class, mechanism)
  ddmin.py         Zeller's delta debugging, generic
  judge.py         one configuration run as cells (experiments.cells: `lpf audit` processes), judged k-of-n
  state.py         DIR/shrink.json: every candidate and its outcome, rewritten after every run
  suspects.py      what the run knows: the requests the trace ties to the target, the knob its top hypothesis names
  search.py        the plan: the suspects, then requests, then lengths, then knobs toward the engine's defaults
  crash.py         a crash as the signature: the exception type and innermost frame of a run's failed requests
  crash_search.py  the plan for a crash: ddmin over every request, their lengths, the knobs
  repro.py         DIR/workload.jsonl, command.sh, repro.py (from repro_script.py), report.md
  session.py       one shrink from start to files: `prepare`, then `run`
Domain modules: they return data and print nothing; `lpf.cli` draws the progress.
"""
