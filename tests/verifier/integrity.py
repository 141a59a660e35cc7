"""What the verifier's integrity and timing tests share: one configuration of a cpu verifier on the
session's cache and the suite's cases made distinct (the relu task is a fixture: conftest.py)."""

from __future__ import annotations

import uuid

from actors.verifier.suite import load_suite
from configs import load_config
from protocols import VerifyRequest

SUITE = {c.name: c for c in load_suite("cpu")}


def config(cache_dir, **overrides):
    base = {
        "verifier.cache_dir": str(cache_dir),
        "verifier.trials": 4,
        "verifier.warmup": 1,
        "verifier.repeats": 8,
        "verifier.run_timeout_s": 20,
        "verifier.memory_limit_mb": 1536,
        "verifier.compile_baseline": "never",
        "verifier.run_workers": 2,
        "verifier.compile_workers": 2,
    }
    base.update(overrides)
    return load_config(None, [f"{k}={v}" for k, v in base.items()]).verifier


def fresh(case: str) -> str:
    """A suite case's source, made distinct (no verdict-cache hit from another module), same build."""
    return SUITE[case].source() + f"\n# {uuid.uuid4().hex}\n"


def verify(verifier, task, source: str, request_id: str = ""):
    return verifier.verify(VerifyRequest(request_id=request_id or uuid.uuid4().hex, task=task, candidate=source))
