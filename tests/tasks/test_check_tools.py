"""The task-set maintainer tools judge by the verifier's own rules: one definition of correct and legal."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from actors.verifier import compare, legality


@pytest.fixture
def check_common(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tasks"))
    import check_common

    return check_common


def test_the_op_allowlist_is_the_verifiers(check_common):
    recorded = {name: 1 for name in sorted(legality.ALLOWED_OPS)} | {"relu": 2, "addmm": 1}
    assert check_common.compute_ops(recorded) == ["addmm", "relu"]
    assert not hasattr(check_common, "ALLOWED_OPS") and not hasattr(check_common, "TOLERANCE")


def test_outputs_are_compared_by_the_verifiers_rule(check_common):
    """Zeros do not pass for an output whose values are all below atol (the tolerance is in units of
    the output's scale), and a task's KILN_TOLERANCE is the override, as in the verifier."""
    expected = torch.full((64,), 1e-5)
    plain = types.SimpleNamespace()
    assert not check_common.compare_with_reference(torch.zeros(64), expected, plain).ok
    assert check_common.compare_with_reference(expected * (1 + 1e-5), expected, plain).ok
    loose = types.SimpleNamespace(KILN_TOLERANCE=0.5)
    near = expected * 1.2
    assert check_common.compare_with_reference(near, expected, loose).ok
    assert not check_common.compare_with_reference(near, expected, plain).ok
    assert compare.declared_tolerance(loose) == (0.5, 0.5)


def test_the_static_scans_are_the_verifiers(check_common):
    assert check_common.static_native_issues("auto y = at::relu(x);")
    assert not check_common.static_native_issues("auto y = torch::empty_like(x);")
