"""The test run's cost per scheduling scope, for the order `make test` hands modules to its workers
(tests/conftest.py): `python -m tests.helpers.durations LOG > tests/durations.json`, LOG being the
output of a full run with `--durations=0` (every setup, call and teardown time).

A scope is a test module, or "demo_run" for the modules that share the session's demo run. Its cost
is the sum of its tests' times. The workers take the costliest scopes first (longest-processing-time
order), so no long module starts last while the other worker idles; a scope the file does not name
(a new module) is costed at the mean per test. The figures only order the run: a stale file costs
some balance, never a test."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

_DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(tests/\S+?)::", re.MULTILINE)


def costs(log: str, scope_of) -> dict[str, float]:
    """Seconds per scope from a `--durations=0` report; `scope_of(module)` names a module's scope."""
    section = log[log.find("slowest durations") :]
    totals: collections.Counter[str] = collections.Counter()
    for seconds, module in _DURATION.findall(section):
        totals[scope_of(module)] += float(seconds)
    return {scope: round(total, 1) for scope, total in sorted(totals.items())}


def main(argv: list[str]) -> int:
    from tests.conftest import scope_of

    if len(argv) != 1:
        print("usage: python -m tests.helpers.durations LOG", file=sys.stderr)
        return 2
    try:
        log = Path(argv[0]).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        print(f"cannot read {argv[0]}: {e.strerror}", file=sys.stderr)
        return 2
    found = costs(log, scope_of)
    if not found:
        print(f"{argv[0]} has no --durations=0 report", file=sys.stderr)
        return 2
    json.dump(found, sys.stdout, indent=0)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
