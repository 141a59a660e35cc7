"""The verifier on CUDA (GPU machine only: `pytest -m gpu tests/verifier/test_gpu.py`): every CUDA
adversarial candidate gets its expected verdict, the shipped CUDA solutions pass, and the verifier
keeps serving after an illegal memory access. `python -m launch.bench.gpu_verifier` runs the same
through the VerifierActor and prints the benchmark figures."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from actors.verifier.suite import as_expected, load_suite, request_for, suite_tasks, verdict
from configs import VerifierConfig
from protocols import VerifyRequest

pytestmark = pytest.mark.gpu
CASES = load_suite("cuda")


@pytest.fixture(scope="module")
def verifier(verifier_cache_dir):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from actors.verifier.verifier import KernelVerifier

    cfg = VerifierConfig(
        backend="cuda",
        cache_dir=str(verifier_cache_dir / "cuda"),
        compile_baseline="never",
        run_workers=2,
        compile_workers=8,
    )
    v = KernelVerifier(cfg)
    yield v
    v.close()


@pytest.fixture(scope="module")
def tasks():
    return suite_tasks("cuda")  # the shipped tasks and the suite's own (tests/adversarial/tasks)


@pytest.fixture(scope="module")
def results(verifier, tasks):
    with ThreadPoolExecutor(8) as pool:
        return dict(
            zip([c.name for c in CASES], pool.map(lambda c: verifier.verify(request_for(c, tasks)), CASES), strict=True)
        )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_adversarial_case(case, results):
    r = results[case.name]
    assert as_expected(verdict(r), case.expect), f"{case.name}: {case.why}\n{r.feedback}\n{r.diagnostics}"


def test_serves_after_an_illegal_memory_access(verifier, tasks, results):
    assert "illegal memory access" in results["illegal_memory_access"].feedback
    control = next(c for c in CASES if c.name == "control_correct").source() + f"\n# {uuid.uuid4().hex}\n"
    r = verifier.verify(VerifyRequest(request_id="after-ima", task=tasks["level1/01_relu"], candidate=control))
    assert r.passed and not r.cached, r.feedback


@pytest.mark.parametrize("task_id", ["level1/01_relu", "level2/03_softmax", "level3/01_matmul_square"])
def test_shipped_cuda_solutions_pass(verifier, tasks, task_id):
    from pathlib import Path

    from tasks.loader import discover, solution_for

    tf = next(t for t in discover("tasks") if t.task_id == task_id)
    source = Path(solution_for(tf, "tasks/solutions/cuda")).read_text()
    r = verifier.verify(VerifyRequest(request_id=task_id, task=tasks[task_id], candidate=source))
    assert r.passed and r.speedup_eager is not None, r.feedback


def test_a_slow_pass_profile_names_its_kernels_by_gpu_time(verifier, tasks, monkeypatch):
    """The profile of a pass on cuda (profile.py): the candidate's own kernel leads, by device time,
    in the feedback; the jailed profiler refuses nothing."""
    from pathlib import Path

    from tasks.loader import discover, solution_for

    monkeypatch.setattr(verifier.cfg, "profile_below", None)  # every pass, whatever its speed on this card
    tf = next(t for t in discover("tasks") if t.task_id == "level1/01_relu")
    source = Path(solution_for(tf, "tasks/solutions/cuda")).read_text() + f"\n# {uuid.uuid4().hex}\n"
    r = verifier.verify(VerifyRequest(request_id="profiled", task=tasks["level1/01_relu"], candidate=source))
    assert r.passed, r.feedback
    profile = r.diagnostics["profile"]
    assert profile.get("where") == "device", profile
    assert "refused_during_profile" not in profile, profile
    name, _seconds, share = profile["top"][0]
    assert "relu_kernel" in name and share > 0.5, profile
    assert 1 <= profile["calls"] <= 3  # the last trip's calls, at most three
    assert f"Profile of {profile['calls']} call" in r.feedback and "relu_kernel" in r.feedback
