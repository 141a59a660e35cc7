"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def verifier_cache_dir(tmp_path_factory):
    """One verifier cache (builds + verdicts) for the whole session: each distinct candidate source
    compiles once per test run, whichever test module asks first."""
    return tmp_path_factory.mktemp("verifier-cache")
