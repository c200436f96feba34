"""Experiments around audits: each one runs many audits (cells) and says what they show together.

  cells.py       one cell: an `AuditSpec` run in its own `lpf audit --spec -` process, the resume rule,
                 the --out document rule every experiment's rerun relies on
  sweep.py       `lpf sweep`: the knob grid's cells, and what moves the failure's shape
  repeat.py      `lpf repeat`: one prompt N times under different batches (in this process)
  shrink/        `lpf shrink`: a failing run cut down to the smallest reproducer
  conformance/   `lpf conformance`: every architecture an engine claims under a grid of knob cells
An experiment is handed `AuditSpec`s (lpf.pipeline.spec) and asks engines' Options about their knobs
(lpf.core.knobs); it never imports click or lpf.cli, and returns documents the command line draws.
"""
