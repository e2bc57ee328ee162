"""Smoke tests of the benchmark scripts in bench/: each runs in a quick mode, its table has
the expected rows, and it refuses to time an op that fails its correctness check."""
