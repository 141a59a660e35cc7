"""Fixtures shared across test modules."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers, each taking whole modules, so a module-scoped
    fixture is built once; the modules that read the session's demo run (`demo_run`) go to one
    worker together, so that run is made once. (xdist's own `loadgroup` marks do not reach the test
    ids under pytest 9.2, hence a scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "demo_run" if reads_the_demo_run(module) else module

    return ByModule(config, log)


@functools.cache
def reads_the_demo_run(module: str) -> bool:
    path = ROOT / module
    return path.is_file() and "demo_run" in path.read_text()


@pytest.fixture(scope="session")
def verifier_cache_dir(tmp_path_factory):
    """One verifier cache (builds + verdicts) for the whole test run: each distinct candidate source
    compiles once, whichever test module, or xdist worker, asks first. The cache is safe across
    processes (builders take a per-key lock and publish by rename), so the workers share it: each
    worker's base directory is a child of the run's."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "verifier-cache"
    path.mkdir(exist_ok=True)
    return path


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
    from launch.driver.tiny_checkpoint import TinyChatSpec, tiny_chat_checkpoint

    return tiny_chat_checkpoint(
        tmp_path_factory.mktemp("models"),
        TinyChatSpec(hidden_size=64, num_layers=2, intermediate_size=128, max_seq_len=8192),
    )


@dataclass(frozen=True)
class DemoRun:
    """The session's end-to-end run (`demo_run`): where it lives and what it showed before its resume."""

    path: Path
    cfg: object  # the KilnConfig of the first session
    rows: list  # metrics rows of the first session
    summary: dict  # summary.json after the first session
    report: str  # report.md after the first session
    index: list  # the episode dumps' index after the first session (what its report saw)
    resumed_summary: dict  # summary.json after the resumed session


# `make demo`'s configuration in its CI-sized form: the test-sized chat checkpoint, and the task set's
# level 2 (5 training tasks and 1 validation task, so candidates repeat and compile once per session);
# the workload (candidate mix, retry probability, δ, learning rate, steps) is the demo's own.
DEMO_CI = [
    "model.max_seq_len=8192",
    "replay.tasks=tasks/level2",
    "warm_start.solutions=tasks/solutions/cpu",
    "warm_start.steps=3",
    "warm_start.lr=1e-3",
    "eval.samples=1",
    "verifier.compile_baseline=never",
]


def demo_run_overrides(root, name: str, model) -> list[str]:
    """A demo-preset run of the tests: in-process, quiet, under `root`, on the test-sized `model`."""
    return [
        f"logging.root={root}",
        f"logging.run_name={name}",
        "logging.live=false",
        "logging.tensorboard=false",
        "cluster.use_ray=false",
        f"model.path={model}",
    ]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, tiny_chat_model, verifier_cache_dir):
    """`make demo`'s configuration (configs/default.yaml) through `kiln train`, in-process, in its CI-sized
    form (DEMO_CI) on the test-sized real-format chat checkpoint: prompts through its chat template, the
    warm start on the shipped solutions, RL steps in which every mechanism of the algorithm acts (the
    report's mechanisms table), a servable export at step 2 (`learner.export_every`), the final
    evaluation and export; then `kiln train --resume` for two more steps. One run per test session:
    test_demo.py and the export tests read it."""
    import torch

    from configs import load_config
    from launch.driver.run_dir import RunDirectory
    from launch.driver.train import train
    from launch.observe.episode_dump import read_index
    from launch.observe.metrics import read_metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models decode fastest on one thread (see one_torch_thread)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ROOT)  # the config's task and solution paths are relative to the repository
            cfg = load_config(
                ROOT / "configs" / "default.yaml",
                [
                    *demo_run_overrides(tmp_path_factory.mktemp("demo"), "demo", tiny_chat_model),
                    f"verifier.cache_dir={verifier_cache_dir}",
                    *DEMO_CI,
                    "learner.checkpoint_every=1",
                    "learner.export_every=2",
                ],
            )
            run = RunDirectory.create(cfg)
            train(cfg, run)
            rows = read_metrics(run.path)
            summary = json.loads((run.path / "summary.json").read_text())
            report = (run.path / "report.md").read_text()
            index = read_index(run.path)
            # `kiln train --resume RUN_DIR algo.total_steps=N+2`: the final checkpoint is the newest
            # state, so the restored learner continues at version N and takes two more steps
            more = load_config(run.config_path, [f"algo.total_steps={cfg.algo.total_steps + 2}"])
            train(more, RunDirectory.open(run.path))
            resumed = json.loads((run.path / "summary.json").read_text())
    finally:
        torch.set_num_threads(threads)
    return DemoRun(
        path=run.path, cfg=cfg, rows=rows, summary=summary, report=report, index=index, resumed_summary=resumed
    )
