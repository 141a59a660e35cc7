"""The records of one extension's build: the plan (user files, compile units, the binding) and each
compile unit. compiler.py makes and runs them; nothing here acts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import cxx_scan


@dataclass
class Unit:
    """One compiler invocation of a build: its source, its object file, its command, how it went."""

    label: str  # kernel | cuda | binding | main
    prelude: str
    source: str  # file name in the build dir
    obj: str
    cmd: list[str]
    profile: tuple[str, ...] | None  # PCH profile for g++ units with a precompiled prelude
    seconds: float = 0.0
    output: str = ""
    ok: bool = False
    infra: bool = False
    how: str = ""  # what to report: the prelude, or "lean->full" after a fallback

    def __post_init__(self) -> None:
        self.how = self.how or self.prelude


@dataclass
class Plan:
    """What one extension's build consists of, decided before anything compiles and revised by the
    fallbacks (ExtensionBuilder._plan, _retry_*)."""

    cpp_names: list[str]
    cu_names: list[str]
    units: list[Unit] = field(default_factory=list)
    bindable: cxx_scan.Bindable | None = None
    binding_obj: Path | None = None  # a cached binding object, when one matched
    notes: list[str] = field(default_factory=list)
    wanted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # toolchain artifacts missed
    facade: bool = False  # the CUDA unit and the binding are (still) facade-built
