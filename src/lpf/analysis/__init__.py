"""Analysis: pure functions over Arrow tables (no torch, no I/O). See DESIGN.md "Metrics"."""
