"""Benchmarks and device checks: tools run by hand (`python -m launch.bench.<name>`), never imported by the runtime."""
