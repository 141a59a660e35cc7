"""The verdict as JSON: the versioned schema `kiln verify --json` prints and the verifier service
(launch/serve) answers with, and the one place that reads it back (the service's clients).

Schema VERDICT_SCHEMA (docs/verifier.md, "The verifier service"):
  schema          int, this version
  task_id         str
  passed          bool
  stage           str: the stage reached (extract, compile, run, correctness, legality, performance,
                  done)
  error_class     str or null: null exactly when passed
  q               float in [0, 1]: the share of correctness trials passed
  score           float: the MooreEval reward
  speedup_eager   float or null: over eager PyTorch, by Kiln's timing protocol
  speedup_compile float or null: over torch.compile
  feedback        str: the text the next repair turn is posed with
  timings         {str: float}: seconds per stage
  diagnostics     {str: JSON}: what each stage found (docs/verifier.md)
  source_hash     str
  cached          bool: answered from the verdict cache

For a remote client (`remote=True`), the diagnostics leave without what describes the host rather than
the candidate: REMOTE_REDACTED, each a path of keys.
"""

from __future__ import annotations

import copy
import math

from protocols.records import ERROR_CLASSES, Stage, VerifyResult
from protocols.schema import ProtocolError

VERDICT_SCHEMA = 1
# Diagnostics fields a remote client never sees: the machine's memory and core counts, the toolchain
# string (compiler and library versions, build flags), the build's cache state and phase timings
# (which show what other clients built), the sandbox's jail report (which layers the host lacks).
REMOTE_REDACTED = (
    ("sandbox", "limits", "machine_mb"),
    ("sandbox", "limits", "floor_mb"),
    ("sandbox", "missing"),
    ("toolchain",),
    ("build", "cached"),
    ("build", "phases"),
    ("device",),
    ("vendor_libs",),
)
STAGES: tuple[str, ...] = Stage.__args__


def to_json(r: VerifyResult, remote: bool = False) -> dict:
    diagnostics = r.diagnostics
    if remote:
        diagnostics = copy.deepcopy(diagnostics)
        for path in REMOTE_REDACTED:
            _drop(diagnostics, path)
    return {
        "schema": VERDICT_SCHEMA,
        "task_id": r.task_id,
        "passed": r.passed,
        "stage": r.stage,
        "error_class": r.error_class,
        "q": r.q,
        "score": r.score,
        "speedup_eager": r.speedup_eager,
        "speedup_compile": r.speedup_compile,
        "feedback": r.feedback,
        "timings": r.timings,
        "diagnostics": diagnostics,
        "source_hash": r.source_hash,
        "cached": r.cached,
    }


def from_json(data: object, request_id: str = "") -> VerifyResult:
    """A verdict read back (ProtocolError naming the first field that is wrong)."""
    if not isinstance(data, dict):
        raise ProtocolError(f"a verdict is a JSON object, not {type(data).__name__}")
    if data.get("schema") != VERDICT_SCHEMA:
        raise ProtocolError(f"verdict schema {data.get('schema')!r}, this client reads {VERDICT_SCHEMA}")
    want = {
        "task_id": str,
        "passed": bool,
        "stage": str,
        "q": (int, float),
        "score": (int, float),
        "feedback": str,
        "timings": dict,
        "diagnostics": dict,
    }
    for key, kind in want.items():
        if not isinstance(data.get(key), kind):
            raise ProtocolError(f"verdict field {key!r} is missing or not {_name(kind)}")
    if data["stage"] not in STAGES:
        raise ProtocolError(f"verdict stage {data['stage']!r} is not one of {', '.join(STAGES)}")
    error = data.get("error_class")
    if error is not None and error not in ERROR_CLASSES:
        raise ProtocolError(f"verdict error_class {error!r} is not a known class")
    speedups = {}
    for key in ("speedup_eager", "speedup_compile"):
        value = data.get(key)
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ProtocolError(f"verdict field {key!r} is not a finite number or null")
        speedups[key] = float(value) if value is not None else None
    result = VerifyResult(
        request_id=request_id,
        task_id=data["task_id"],
        passed=data["passed"],
        stage=data["stage"],
        error_class=error,
        q=float(data["q"]),
        score=float(data["score"]),
        feedback=data["feedback"],
        diagnostics=data["diagnostics"],
        timings={str(k): float(v) for k, v in data["timings"].items() if isinstance(v, (int, float))},
        source_hash=str(data.get("source_hash") or ""),
        cached=bool(data.get("cached")),
        **speedups,
    )
    try:
        result.check()
    except (ValueError, AssertionError) as err:
        raise ProtocolError(f"verdict is inconsistent: {err}") from None
    return result


def _drop(tree: dict, path: tuple[str, ...]) -> None:
    for key in path[:-1]:
        tree = tree.get(key) if isinstance(tree, dict) else None
        if not isinstance(tree, dict):
            return
    tree.pop(path[-1], None)


def _name(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
