"""Honest CUDA candidates for the ten largest KernelBench level 1-3 problems (issue 34); see README.md."""
