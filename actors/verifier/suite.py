"""The adversarial suite: candidate files that try the published reward hacks, each with the verdict
the verifier must give it.

A case is one .py file under tests/adversarial/{cpu,cuda}/, or under tests/adversarial/common/ when
the same text applies to every backend, that starts with

    # kiln-adversarial: task=level1/01_relu expect=cheating
    # one line saying what the candidate tries

`expect` is an error class (cheating, correctness, runtime, timeout, ...) or `pass` for the control
cases; `a|b` where the case races the verifier and either verdict is right (a wrong answer that fills
the GPU is caught wrong, or its fill is caught first: both are its -1, neither is `infra`). An optional `config=section.key=value[,section.key=value]` after it names the verifier settings
the verdict holds under (a case about switching vendor libraries off runs with them off). Cases built on the same extension hold it once: a line

    # kiln-adversarial-include: _relu_extension.py

stands for that file of the backend's directory (a name starting with "_" is not a case), so the
verifier gets the same text as if it were written out, and identical extensions are built once per
run. A common case that includes the relu extension thus gets the C++ one on cpu and the CUDA one on
cuda. The suite runs the same way in CI (cpu) and on the GPU machine
(`python -m launch.bench.gpu_verifier`, cuda). Tasks that exist only for the suite (a reference whose
outputs are all tiny, one that produces NaN) live in tests/adversarial/tasks/ (`suite_tasks`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from protocols import Task, VerifyRequest, VerifyResult

REPO = Path(__file__).resolve().parents[2]


def suite_dir() -> Path:
    """tests/adversarial of the checkout: the working directory's when run from a checkout (Kiln may
    be installed without its tests), else next to this package."""
    here = Path.cwd() / "tests" / "adversarial"
    return here if here.is_dir() else REPO / "tests" / "adversarial"


_HEADER = re.compile(r"^# kiln-adversarial: task=(\S+) expect=(\S+)(?: config=(\S+))?\s*$")
_INCLUDE = re.compile(r"^# kiln-adversarial-include: (_\w+\.py)\s*$")


@dataclass(frozen=True)
class SuiteCase:
    name: str
    path: Path
    task_id: str
    expect: str  # an error class, or "pass"; "a|b": either
    why: str
    include_dir: Path  # where its include lines are resolved: the backend's directory
    config: tuple[str, ...] = ()  # verifier overrides the verdict holds under ("verifier.x.y=z")

    def source(self) -> str:
        """The candidate as the verifier gets it: the file, each include line replaced by the file it names."""
        parts = []
        for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            m = _INCLUDE.match(line)
            if m is None:
                parts.append(line)
                continue
            shared = self.include_dir / m.group(1)
            if not shared.is_file():
                raise ValueError(f"{self.path}: includes {m.group(1)}, which is not in {self.include_dir}")
            parts.append(shared.read_text(encoding="utf-8"))
        return "".join(parts)


def load_suite(backend: str, root: Path | None = None) -> list[SuiteCase]:
    """The backend's cases and the common ones, by name; a name in both is an error."""
    root = root or suite_dir()
    cases: dict[str, SuiteCase] = {}
    for path in sorted((root / backend).glob("*.py")) + sorted((root / "common").glob("*.py")):
        if path.name.startswith("_"):  # shared text that cases include, not a case
            continue
        if path.stem in cases:
            raise ValueError(f"{path}: the case {path.stem!r} is also in {cases[path.stem].path.parent}")
        lines = path.read_text(encoding="utf-8").splitlines()
        m = _HEADER.match(lines[0]) if lines else None
        if m is None:
            raise ValueError(f"{path}: first line must be '# kiln-adversarial: task=... expect=...'")
        why = lines[1].lstrip("# ").strip() if len(lines) > 1 else ""
        config = tuple(c for c in (m.group(3) or "").split(",") if c)
        case = SuiteCase(path.stem, path, m.group(1), m.group(2), why, root / backend, config)
        case.source()  # an include that is not there stops the suite here, naming the case
        cases[case.name] = case
    return [cases[name] for name in sorted(cases)]


def suite_tasks(backend: str, tasks_dir: str | Path = "tasks", root: Path | None = None) -> dict[str, Task]:
    """The tasks the suite's cases name: the shipped ones and tests/adversarial/tasks/."""
    from tasks.loader import load_tasks

    found = {t.task_id: t for t in load_tasks(tasks_dir, backend)}
    extra = (root or suite_dir()) / "tasks"
    if extra.is_dir():
        found.update({t.task_id: t for t in load_tasks(extra, backend)})
    return found


def verdict(result: VerifyResult) -> str:
    return "pass" if result.passed else str(result.error_class)


def as_expected(got: str, expect: str) -> bool:
    """Whether verdict `got` is one the case's `expect` allows."""
    return got in expect.split("|")


def request_for(case: SuiteCase, tasks: dict[str, Task]) -> VerifyRequest:
    return VerifyRequest(
        request_id=f"{case.name}-{uuid.uuid4().hex[:8]}", task=tasks[case.task_id], candidate=case.source()
    )
