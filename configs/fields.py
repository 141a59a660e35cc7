"""The one way a config field is declared: `F(default, help, ...bounds)` (configs/schema.py says why)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def F(default: Any, help: str, *, ge=None, gt=None, le=None, lt=None, choices=None, dotted_ok=False):
    """A config field: default, one-line help (the field's comment) and bounds checked at load.
    `dotted_ok` lets a choice field also take a dotted import path (a plug-in)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "dotted_ok": dotted_ok}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = (lambda d=default: type(d)(d)) if isinstance(default, (list, dict)) else type(default)
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
