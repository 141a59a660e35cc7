"""Benchmarks and GPU acceptance checks: tools run by hand, never imported by the runtime."""
