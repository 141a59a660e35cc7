"""A pass's profile: which kernels its time goes to, as feedback for a performance turn; never reward.

After the timed stage of a run that passed but is not fast (speedup over eager below
`verifier.profile_below`), the sandbox runs the last trip's calls once more under torch's profiler
(sealed_profile.make_op_profile): on cuda the device's activity (kernels, copies, memsets), on cpu the host's
torch operators. The events come back as data, and `summarize` here (trusted code) turns them into
the costliest names and their shares, which the pass's feedback quotes (verifier.py).

Why this never reaches the verdict:
- It runs after every figure and check of the run. The evidence the sandbox logged before it has
  already been taken into the verdict (`take`), and what it logs during the profile is recorded in
  the diagnostics only. So the profiler's own work inside the jail cannot make an honest pass read
  as cheating, and nothing a candidate does while profiled changes its score: the figures are fixed.
- A profile that fails, hangs or crashes the sandbox leaves the verdict as it was, with the reason
  in the diagnostics. A hang costs at most PROFILE_TIMEOUT_S.
- The events are the candidate's to forge (they come from its process). A forged profile misleads
  only the candidate's own next turn.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.verifier.executor import ChildSession, SandboxFailure

if TYPE_CHECKING:
    from actors.verifier.runner import CandidateRun

PROFILE_CALLS = 3  # calls profiled: the last trip's first ones (already staged on the device)
MAX_EVENTS = 2048  # events the sandbox sends at most (160-character names: well under a reply's 1 MB)
PROFILE_TIMEOUT_S = 10.0  # the profile request's limit (never more than the run's time left)
NAME_CHARS = 100  # a name as the feedback quotes it


@dataclass(frozen=True)
class Entry:
    name: str  # the kernel's (cuda) or the operator's (cpu) name, cut to NAME_CHARS
    seconds: float  # its time per profiled call
    share: float  # of the time of all the names profiled


@dataclass(frozen=True)
class KernelProfile:
    where: str  # "device" (cuda: kernels, copies, memsets) or "host" (cpu: torch operators)
    calls: int
    call_s: float  # wall time per profiled call, the profiler's overhead included
    busy_s: float  # the names' time per call (on the host: outermost operators only)
    top: tuple[Entry, ...]

    def feedback(self) -> str:
        """One paragraph for the pass's feedback: per-call times, then the costliest names."""
        what = "GPU kernels and copies" if self.where == "device" else "torch operators"
        rest = "" if self.where == "device" else " (the rest is your own code)"
        text = (
            f"Profile of {self.calls} call{'s' if self.calls != 1 else ''} ({_ms(self.call_s)} each): "
            f"{what} ran {_ms(self.busy_s)} per call{rest}."
        )
        if self.top:
            text += " By time: " + "; ".join(f"{e.share:.0%} {e.name}" for e in self.top) + "."
        return text

    def to_json(self) -> dict:
        return {
            "where": self.where,
            "calls": self.calls,
            "call_s": self.call_s,
            "busy_s": self.busy_s,
            "top": [[e.name, e.seconds, e.share] for e in self.top],
            "feedback": self.feedback(),
        }


def wanted(run: CandidateRun) -> bool:
    """A pass whose speed over eager is known and below `verifier.profile_below`: the passes that get
    a performance turn with the default rules (rollout.optimize_until = eval.fast_threshold)."""
    cfg, out = run.cfg, run.out
    if cfg.profile_kernels <= 0 or out.stage != "done" or out.error_class or out.violations or out.implausible:
        return False
    if not out.eager_s or not out.candidate_s:
        return False
    return cfg.profile_below is None or out.eager_s / out.candidate_s < cfg.profile_below


def take(run: CandidateRun, child: ChildSession) -> None:
    """Profile the pass in its sandbox; `run.out.profile` gets the summary or the reason there is none."""
    out = run.out
    out.absorb_evidence(child)  # what the sandbox logged up to here counts toward the verdict
    started = time.perf_counter()
    try:
        with run.lease.shared():
            reply = child.request(
                "profile",
                {"calls": PROFILE_CALLS, "events": MAX_EVENTS},
                min(max(run.budget.left, 0.5), PROFILE_TIMEOUT_S),
            )
    except SandboxFailure as err:
        reply = {"error": f"the profile run failed: {err}"}
    finally:
        out.timings["profile"] = time.perf_counter() - started
        child.drain_evidence()
        during = [f"{v.kind}: {v.what}"[:120] for v in child.evidence]
        child.evidence.clear()  # the profile's evidence is recorded, never judged (the docstring says why)
    summary = summarize(reply, run.cfg.profile_kernels, "device" if run.device_type == "cuda" else "host")
    out.profile = summary.to_json() if isinstance(summary, KernelProfile) else {"error": summary}
    if during:
        out.profile["refused_during_profile"] = during[:10]


def summarize(reply: dict, top: int, where: str) -> KernelProfile | str:
    """The profile in the sandbox's reply (read as data: anything malformed is left out), or why there
    is none. Device events are summed by name. Host operators nest (aten::empty_like calls
    aten::empty_strided), so only the outermost ones on each thread count."""
    if reply.get("error") or reply.get("failure") or not reply.get("ok"):
        return str(reply.get("error") or reply.get("failure") or "the sandbox gave no profile")[:300]
    calls, wall = reply.get("calls"), reply.get("wall_s")
    if type(calls) is not int or calls <= 0 or type(wall) is not float or not math.isfinite(wall) or wall < 0:
        return "the profile reply has no call count or wall time"
    events = reply.get("events")
    events = [e for e in events if _well_formed(e)] if type(events) is list else []
    if where == "host":
        events = _outermost(events)
    totals: dict[str, int] = {}
    for name, start, end, _thread in events:
        totals[name] = totals.get(name, 0) + (end - start)
    busy = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[: max(0, top)]
    return KernelProfile(
        where=where,
        calls=calls,
        call_s=wall / calls,
        busy_s=busy * 1e-9 / calls,
        top=tuple(Entry(_short(name), ns * 1e-9 / calls, ns / busy if busy else 0.0) for name, ns in ranked),
    )


def _well_formed(e) -> bool:
    return (
        type(e) is list
        and len(e) == 4
        and type(e[0]) is str
        and all(type(x) is int for x in e[1:])
        and 0 <= e[1] <= e[2]
    )


def _outermost(events: list) -> list:
    """The events not inside another event of the same thread."""
    kept, reach = [], {}
    for e in sorted(events, key=lambda e: (e[3], e[1], -e[2])):
        if e[1] >= reach.get(e[3], -1):
            kept.append(e)
        reach[e[3]] = max(reach.get(e[3], -1), e[2])
    return kept


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
