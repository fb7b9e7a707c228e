"""Benchmarks: what the transfer plane achieves, side by side with the machine's limits."""
