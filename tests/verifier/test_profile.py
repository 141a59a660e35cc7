"""A slow pass's profile (actors/verifier/profile.py): the costliest kernels by time, quoted in the
pass's feedback for a performance turn, and never part of the verdict. The summary is hand-computed
here; on cpu the whole path runs (the sandbox's `profile` request under the seal, the summary, the
feedback); tests/verifier/test_gpu.py checks the kernel names on cuda."""

from __future__ import annotations

import uuid

import pytest

from actors.verifier.profile import NAME_CHARS, PROFILE_CALLS, KernelProfile, summarize
from actors.verifier.suite import load_suite
from actors.verifier.verifier import KernelVerifier
from configs import load_config
from protocols import VerifyRequest

SUITE = {c.name: c for c in load_suite("cpu")}


def _reply(events, calls=2, wall_s=0.002):
    return {"ok": True, "events": events, "calls": calls, "wall_s": wall_s}


def test_device_events_are_summed_by_name_and_ranked():
    got = summarize(_reply([["k1", 0, 300, 1], ["k2", 300, 400, 1], ["k1", 500, 800, 1]]), 5, "device")
    assert isinstance(got, KernelProfile)
    assert got.calls == 2 and got.call_s == pytest.approx(0.001)
    assert got.busy_s == pytest.approx(350e-9)  # (300 + 100 + 300) ns over 2 calls
    assert [(e.name, round(e.share, 4)) for e in got.top] == [("k1", round(6 / 7, 4)), ("k2", round(1 / 7, 4))]
    assert got.top[0].seconds == pytest.approx(300e-9)
    text = got.feedback()
    assert text.startswith("Profile of 2 calls (1.000 ms each): GPU kernels and copies ran 0.000 ms per call.")
    assert "By time: 86% k1; 14% k2." in text


def test_host_operators_count_only_the_outermost_on_each_thread():
    events = [
        ["aten::empty_like", 0, 100, 7],
        ["aten::empty_strided", 10, 60, 7],  # inside empty_like: not counted again
        ["aten::add", 200, 260, 7],
        ["aten::empty", 0, 30, 8],  # another thread: outermost there
    ]
    got = summarize(_reply(events, calls=1), 5, "host")
    assert [(e.name, e.seconds) for e in got.top] == [
        ("aten::empty_like", pytest.approx(100e-9)),
        ("aten::add", pytest.approx(60e-9)),
        ("aten::empty", pytest.approx(30e-9)),
    ]
    assert got.busy_s == pytest.approx(190e-9)
    assert "(the rest is your own code)" in got.feedback()


def test_the_top_is_cut_to_n_and_long_names_are_shortened():
    long = "void cutlass::Kernel<" + "x" * 300 + ">"
    events = [[f"k{i}", 0, 10 * (i + 1), 1] for i in range(8)] + [[long, 0, 1000, 1]]
    got = summarize(_reply(events), 3, "device")
    assert len(got.top) == 3
    assert got.top[0].name.startswith("void cutlass::Kernel<") and len(got.top[0].name) == NAME_CHARS
    assert [e.name for e in got.top[1:]] == ["k7", "k6"]


@pytest.mark.parametrize(
    "reply, why",
    [
        ({"error": "the profile run failed: no answer within 10 s"}, "no answer"),
        ({"ok": True, "failure": "RuntimeError: profiler already enabled", "raised": True}, "already enabled"),
        (_reply([], calls=0), "no call count"),
        (_reply([], calls="3"), "no call count"),
        (_reply([], wall_s=float("nan")), "no call count"),
    ],
)
def test_a_profile_that_did_not_run_says_why(reply, why):
    got = summarize(reply, 5, "device")
    assert isinstance(got, str) and why in got


def test_malformed_events_are_left_out():
    events = [
        ["ok", 0, 10, 1],
        "a string",
        ["short", 0, 10],
        ["backwards", 10, 0, 1],
        ["negative", -5, 10, 1],
        [b"bytes", 0, 10, 1],
        ["float", 0.0, 10, 1],
        ["bool", True, 10, 1],
    ]
    got = summarize(_reply(events), 10, "device")
    assert [e.name for e in got.top] == ["ok"]
    for not_a_list in (5, "events", {"k": [0, 1, 2]}):
        assert summarize(_reply(not_a_list), 10, "device").top == ()


# ----------------------------------------------------------------------- the whole path, on cpu


@pytest.fixture(scope="module")
def verifiers(verifier_cache_dir):
    """(profiling every pass, profiling off): the same settings otherwise."""
    base = {
        "verifier.cache_dir": verifier_cache_dir,
        "verifier.trials": 3,
        "verifier.compile_baseline": "never",
        "verifier.repeats": 3,
    }

    def make(**extra):
        items = {**base, **extra}
        return KernelVerifier(load_config(None, [f"{k}={v}" for k, v in items.items()]).verifier)

    on, off = make(**{"verifier.profile_below": "null"}), make(**{"verifier.profile_kernels": 0})
    yield on, off
    on.close()
    off.close()


def _verify(verifier, task, source):
    source = source + f"\n# {uuid.uuid4().hex}\n"  # a fresh execution: no verdict-cache hit
    return verifier.verify(VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=source))


def _profile_words(profile: dict) -> str:
    return f"Profile of {profile['calls']} call{'s' if profile['calls'] != 1 else ''} ("


def test_a_pass_is_profiled_in_its_sandbox_and_the_feedback_quotes_it(verifiers, relu_task):
    on, off = verifiers
    r = _verify(on, relu_task, SUITE["control_correct"].source())
    assert r.passed, r.feedback
    profile = r.diagnostics["profile"]
    # the last trip's first calls, at most PROFILE_CALLS: a trip holds K calls, and K follows the measured
    # speed (a noisy 2-core host can time a 0.5 ms call slow enough for K = 1 or 2)
    assert profile["where"] == "host" and 1 <= profile["calls"] <= PROFILE_CALLS and profile["call_s"] > 0
    # the extension allocates its output through ATen (torch::empty_like): an operator the profiler sees
    names = [name for name, _s, _share in profile["top"]]
    assert "aten::empty_like" in names, profile
    assert "refused_during_profile" not in profile
    assert _profile_words(profile) in r.feedback and "aten::empty_like" in r.feedback
    plain = _verify(off, relu_task, SUITE["control_correct"].source())
    assert plain.passed and "profile" not in plain.diagnostics and "Profile of" not in plain.feedback


@pytest.mark.parametrize("during", ["clean_exit", "refusal"])
def test_what_happens_during_the_profile_never_changes_the_verdict(verifiers, relu_task, monkeypatch, during):
    """The sandbox exits with status 0 while profiled (in a timed call that is a finding: an exit
    mid-run), or the seal logs a refusal then: the pass keeps its verdict and its figures, and the
    profile records what happened. (A candidate that tests for the profiler itself is refused by the
    static check first, so the sandbox's side is played here by the session.)"""
    from actors.verifier.executor import ChildSession
    from actors.verifier.legality import Violation

    real = ChildSession.request

    def request(self, op, body, budget_s, **kw):
        if op != "profile":
            return real(self, op, body, budget_s, **kw)
        if during == "clean_exit":
            return real(self, "close", {}, budget_s, **kw)  # the loop returns 0: the process exits cleanly
        reply = real(self, op, body, budget_s, **kw)
        self.evidence.append(Violation("introspection", "gc.get_objects", "", "walking the heap"))
        return reply

    monkeypatch.setattr(ChildSession, "request", request)
    on, _off = verifiers
    r = _verify(on, relu_task, SUITE["control_correct"].source())
    assert r.passed and r.error_class is None and r.stage == "done", r.feedback
    assert r.speedup_eager is not None and r.score > 0
    profile = r.diagnostics["profile"]
    if during == "clean_exit":
        assert "the profile run failed" in profile["error"] and "Profile of" not in r.feedback
    else:
        assert profile["refused_during_profile"] == ["introspection: gc.get_objects"]
        assert _profile_words(profile) in r.feedback
