"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def verifier_cache_dir(tmp_path_factory):
    """One verifier cache (builds + verdicts) for the whole session: each distinct candidate source
    compiles once per test run, whichever test module asks first."""
    return tmp_path_factory.mktemp("verifier-cache")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs Ray actors (started on first use, shut down at
    the end of the session; an instance already running is shared and left running)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models decode fastest on one thread, and a shared CI core makes OpenMP's spinning threads
    stall each other; modules opt in with `pytestmark`, and the setting is restored after them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """The tiny real-format chat checkpoint (BPE tokenizer, chat template, safetensors), built once per
    test run; tests that need the road a user's checkpoint takes use this directory as model.path."""
    from launch.tiny_checkpoint import TinyChatSpec, tiny_chat_checkpoint

    return tiny_chat_checkpoint(tmp_path_factory.mktemp("models"),
                                TinyChatSpec(hidden_size=64, num_layers=2, intermediate_size=128, max_seq_len=4096))
