"""The benchmarks of bench/run.py, one module each (`bench(ctx) -> dict`: title, table, ratios, raw)."""
