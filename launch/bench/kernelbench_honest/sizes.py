"""Rank KernelBench problems by the bytes of their inputs plus reference outputs, without allocating.

    python -m launch.bench.kernelbench_honest.sizes KB_ROOT [--levels 1 2 3] [--top 20]

Each problem's module is executed in this process (trusted: KernelBench's own references), then
`get_init_inputs()`, `Model(...)`, `get_inputs()` and `forward` run under `torch.device("meta")`, so
only shapes and dtypes exist. A problem whose forward does not run on meta tensors is reported with
its input bytes only (outputs "?").
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path


def _bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes(o) for o in obj.values())
    return 0


def problem_bytes(path: Path) -> tuple[int, int | None, str]:
    """(input bytes, output bytes or None, note) for one KernelBench problem file."""
    import torch

    module = types.ModuleType(f"kb_{path.stem}")
    module.__file__ = str(path)
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)  # noqa: S102 - trusted reference
    with torch.device("meta"):
        init = module.get_init_inputs()
        inputs = module.get_inputs()
        in_bytes = _bytes(inputs)
        try:
            model = module.Model(*init)
            with torch.no_grad():
                out = model(*inputs)
        except Exception as err:  # noqa: BLE001 - a forward without meta support: outputs unknown
            return in_bytes, None, f"{type(err).__name__}: {' '.join(str(err).split())[:80]}"
    return in_bytes, _bytes(out), ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kb_root", help="KernelBench checkout (the directory holding level1/, level2/, ...)")
    p.add_argument("--levels", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    root = Path(args.kb_root)
    if (root / "KernelBench").is_dir():
        root = root / "KernelBench"
    rows = []
    for level in args.levels:
        for f in sorted((root / f"level{level}").glob("*.py")):
            try:
                i, o, note = problem_bytes(f)
            except Exception as err:  # noqa: BLE001 - report and go on
                print(f"{f.name}: {type(err).__name__}: {err}", file=sys.stderr)
                continue
            rows.append((i + (o or 0), i, o, f"level{level}/{f.stem}", note))
    rows.sort(reverse=True)
    for total, i, o, name, note in rows[: args.top]:
        out = f"{o / 2**20:10.0f}" if o is not None else "         ?"
        print(f"{total / 2**20:10.0f} MiB  in {i / 2**20:10.0f}  out {out}  {name}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
