"""`python -m launch.bench.gpu_verifier`'s throughput mix (the run itself needs a GPU: tests/verifier/test_gpu.py):
`--copies K` sends each shipped solution K times, every copy after the first distinct in its kernel source, so
that each one compiles; bad values are a one-line usage error."""

from __future__ import annotations

import pytest

from launch.bench import gpu_verifier


def test_copies_are_distinct_in_their_kernel_source_and_otherwise_the_solution():
    # Mutation: `_copy` returning the source unchanged -> the copies share one build and one verdict.
    args = gpu_verifier.parse_args(["--backend", "cpu", "--mix", "solutions", "--copies", "3"])
    work = gpu_verifier.jobs(args)
    once = gpu_verifier.jobs(gpu_verifier.parse_args(["--backend", "cpu", "--mix", "solutions"]))
    assert len(work) == 3 * len(once) and {expect for _, expect, _ in work} == {"pass"}
    shipped = {name: request.candidate for name, _, request in once}
    for name, source in shipped.items():
        copies = [r.candidate for n, _, r in work if n.startswith(f"{name} #")]
        assert len(copies) == 3 and copies[0] == source and len(set(copies)) == 3
        for copy in copies[1:]:
            # the copy is the solution with one comment line added inside its C++ source string
            extra = [line for line in copy.splitlines() if line not in source.splitlines()]
            assert len(extra) == 1 and extra[0].startswith("// gpu_verifier copy "), extra


def test_copies_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_verifier.parse_args(["--copies", "0"])
    assert exit_.value.code == 2 and "--copies must be at least 1" in capsys.readouterr().err


def test_a_differing_verdict_is_printed_with_its_whole_feedback(capsys):
    # Mutation: only the table's first feedback line printed -> the finding's detail is lost.
    from protocols import VerifyResult

    feedback = "Rejected by the legality check (score -1):\n  line 12: the kernel read the L2 flush buffer\n  (detail)"
    common = {"task_id": "level1/01_relu", "q": 0.0}
    wrong = VerifyResult(
        request_id="a", passed=False, stage="legality", error_class="cheating", score=-1.0, feedback=feedback, **common
    )
    right = VerifyResult(
        request_id="b",
        passed=True,
        stage="done",
        error_class=None,
        score=1.0,
        feedback="Correct.\nTime: 1 ms",
        **common,
    )
    rows = [("solution level1/01_relu #2", "pass", wrong), ("solution level1/02_gelu_tanh", "pass", right)]
    assert gpu_verifier._print_table(rows) is False
    out = capsys.readouterr().out
    assert "--- solution level1/01_relu #2: cheating at legality" in out
    assert "    line 12: the kernel read the L2 flush buffer" in out and "    (detail)" in out
    assert "--- solution level1/02_gelu_tanh" not in out and "Time: 1 ms" not in out  # as expected: the table's line
