"""Activation functions: pointwise nonlinearities, some with a drawn constant (a slope, a range).

Shape rule: any float tensor; the output has its shape.
"""

from __future__ import annotations

from tasks.synth.ops.base import Pointwise


def _act(name: str, template: str, label: str = "", constants: tuple = ()) -> Pointwise:
    return Pointwise(name, "activation", template, label, constants)


OPS = [
    _act("relu", "torch.relu({x})"),
    _act("leaky_relu", "F.leaky_relu({x}, negative_slope={c})", "negative_slope", (0.01, 0.05, 0.1, 0.2)),
    _act("gelu", "F.gelu({x})"),
    _act("gelu_tanh", 'F.gelu({x}, approximate="tanh")'),
    _act("silu", "F.silu({x})"),
    _act("sigmoid", "torch.sigmoid({x})"),
    _act("tanh", "torch.tanh({x})"),
    _act("elu", "F.elu({x}, alpha={c})", "alpha", (1.0, 0.5)),
    _act("hardtanh", "F.hardtanh({x}, min_val={lo}, max_val={hi})", "range", ((-1.0, 1.0), (-0.5, 1.5), (-2.0, 2.0))),
    _act("softplus", "F.softplus({x})"),
    _act("mish", "F.mish({x})"),
    _act("hardswish", "F.hardswish({x})"),
]
