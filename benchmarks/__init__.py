"""Benchmarks (not part of the library): ``python benchmarks/memory.py --help``."""
