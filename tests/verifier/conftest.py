"""Fixtures the verifier's test modules share."""

from __future__ import annotations

import pytest

from tasks.loader import load_tasks


@pytest.fixture(scope="module")
def relu_task():
    return next(t for t in load_tasks("tasks/level1", "cpu") if t.task_id == "level1/01_relu")
