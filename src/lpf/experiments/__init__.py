"""Experiments around audits: each one runs many audits (cells) and says what they show together.

  sweep.py       `lpf sweep`: the knob grid's cells (each one `lpf audit` process, resumable), and what
                 moves the failure's shape
  repeat.py      `lpf repeat`: one prompt N times under different batches (in this process)
  shrink/        `lpf shrink`: a failing run cut down to the smallest reproducer
  conformance/   `lpf conformance`: every architecture an engine claims under a grid of knob cells
They return documents that the command line draws.
"""
