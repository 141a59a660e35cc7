"""Answer sets produced elsewhere: `kiln eval --answers FILE.jsonl`.

Each line is one record, `{"task_id": "level1/01_relu", "sample": 0, "text": "<the raw model
output>"}`, with task ids as Kiln names them (`level<N>/<file stem>`). A line that is not such a
record, or a second answer for one (task_id, sample) pair, makes the file unusable (`AnswersError`:
`kiln eval` says which line and exits non-zero before verifying anything), since an evaluation of
what is left would report Pass@k over other answers than the file's author meant. Answers to tasks
that were not loaded (a subset of the tasks given with --tasks, or a task file that failed to load)
are listed with their reason and left out.

As a tool, it writes an answer set from a solutions directory (the shipped solutions, for a
verifier check on a GPU machine), optionally with the mechanical broken variants of each solution
that the forced-candidate mode uses (a compile error, a wrong result, a PyTorch fallback, a cut-off
answer):

    python -m launch.stages.eval.answers --tasks tasks --solutions tasks/solutions/cuda --out answers.jsonl [--variants]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from launch.observe.words import plural
from protocols import Task


@dataclass(frozen=True)
class AnswerRecord:
    task_id: str
    sample: int
    text: str


@dataclass(frozen=True)
class AnswerSet:
    answers: list[AnswerRecord]
    rejected: list[str]  # one line each: "line 3: ..." / "level9/x sample 0: no such task loaded"


class AnswersError(ValueError):
    """The answers file cannot be read, or holds a line that is not an answer record."""


def read_answers(path: str | Path, task_ids: set[str]) -> AnswerSet:
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise AnswersError(f"cannot read answers file {path}: {err.strerror}") from None
    answers, rejected, malformed, seen = [], [], [], set()
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        record, problem = _parse(line)
        if problem:
            malformed.append(f"line {number}: {problem}")
        elif (record.task_id, record.sample) in seen:
            malformed.append(f"line {number}: a second answer for {record.task_id} sample {record.sample}")
        elif record.task_id not in task_ids:
            rejected.append(f"line {number}: task {record.task_id!r} was not loaded from --tasks")
        else:
            answers.append(record)
        if not problem:
            seen.add((record.task_id, record.sample))
    if malformed:
        more = f" (and {plural(len(malformed) - 1, 'more such line')})" if len(malformed) > 1 else ""
        raise AnswersError(f"answers file {path} {malformed[0]}{more}; fix or remove it")
    return AnswerSet(answers=answers, rejected=rejected)


def _parse(line: bytes) -> tuple[AnswerRecord | None, str]:
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"not JSON ({str(err).splitlines()[0][:80]})"
    if not isinstance(row, dict):
        return None, "not a JSON object"
    task_id, sample, text = row.get("task_id"), row.get("sample"), row.get("text")
    if not isinstance(task_id, str) or not task_id:
        return None, 'no "task_id" string'
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        return None, '"sample" must be an integer >= 0'
    if not isinstance(text, str):
        return None, 'no "text" string'
    return AnswerRecord(task_id=task_id, sample=sample, text=text), ""


def answers_from_solutions(tasks: list[Task], solutions: Path, *, variants: bool) -> list[AnswerRecord]:
    """Sample 0 is the task's solution file (fenced, as a model would answer); with `variants`,
    samples 1.. are its broken variants (actors/rollout/forced.py). Tasks without a solution get none."""
    from actors.rollout.forced import candidates

    out = []
    for task in tasks:
        pool = candidates(task, solutions)
        for sample, text in enumerate(pool if variants else pool[:1]):
            out.append(AnswerRecord(task_id=task.task_id, sample=sample, text=text))
    return out


def main(argv: list[str] | None = None) -> int:
    from launch.stages.eval.sources import load_task_set
    from tasks.loader import TaskLoadError

    p = argparse.ArgumentParser(
        prog="python -m launch.stages.eval.answers",
        description="write an answer set (JSONL) from a solutions directory",
    )
    p.add_argument("--tasks", nargs="+", required=True, metavar="DIR")
    p.add_argument("--solutions", required=True, metavar="DIR")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.add_argument("--variants", action="store_true", help="also the broken variants of each solution")
    args = p.parse_args(argv)
    if not Path(args.solutions).is_dir():
        print(f"answers: solutions directory not found: {args.solutions}", file=sys.stderr)
        return 2
    try:
        task_set = load_task_set(args.tasks, "cpu")
    except TaskLoadError as err:
        print(f"answers: {err}", file=sys.stderr)
        return 2
    records = answers_from_solutions(task_set.tasks, Path(args.solutions), variants=args.variants)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"task_id": r.task_id, "sample": r.sample, "text": r.text}) + "\n" for r in records)
    print(
        f"wrote {plural(len(records), 'answer')} for {len({r.task_id for r in records})} of "
        f"{plural(len(task_set.tasks), 'task')} to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
