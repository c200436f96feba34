"""The run directory: manifest, Parquet parts, atomic appends and resume. See DESIGN.md."""
