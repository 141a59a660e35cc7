"""Benchmarks and device checks: tools run by hand (`python -m launch.bench.<name>`), not by the runtime."""
