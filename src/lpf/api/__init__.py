"""The Python API (`import lpf`): audits and comparisons from a test or a notebook, typed findings to assert on.

  audit.py     lpf.audit(spec | **settings) -> Findings: `lpf audit` without the terminal
  compare.py   lpf.compare(outputs, reference=..., dtype=..., rule=...) and Reference (the model loaded once):
               outputs a test produced with its own engine, written as a run directory, rescored, analysed
  outputs.py   what compare accepts (lists, numpy, Arrow, vLLM's logprob dicts), read or refused in one line
  findings.py  Findings (verdict, counts, flagged requests and their mechanisms, run test, the peer's rule,
               run directory) and Findings.check(fail_on=...), the AssertionError a test log shows
It sits beside the command line (it calls the pipeline, never the CLI) and imports nothing heavy until a
function runs. `lpf.pytest_plugin` builds its fixtures on it.
"""
