"""kvtier benchmarks (run with ``kvtier bench`` or ``python -m benchmarks.<name>``)."""
