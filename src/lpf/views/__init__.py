"""Reading finished directories for people: the logic behind `lpf query`, `lpf inspect` and `lpf diff`.

  query.py     DuckDB SQL over a run directory's Parquet parts (one view per table)
  inspect.py   one request token by token, and its trace step by step
  diff.py      two analysed runs checked comparable, then `analysis.diff` (pure: who departs)
They return data and print nothing; `lpf.cli.render` draws it.
"""
