"""The op registry: every op the generator can place, grouped by family, and the graph cost model.

Families (`--ops` accepts family names and op names alike):

    elementwise    scale shift abs square clamp add sub mul maximum minimum bias_add feature_scale where
    activation     relu leaky_relu gelu gelu_tanh silu sigmoid tanh elu hardtanh softplus mish hardswish
    reduction      sum mean amax amin logsumexp var norm
    normalisation  layer_norm rms_norm group_norm softmax log_softmax l2_normalize
    matmul         linear matmul matmul_nt
    conv           conv1d conv2d depthwise_conv2d conv_transpose2d
    pooling        max_pool1d avg_pool1d max_pool2d avg_pool2d adaptive_avg_pool2d
    layout         transpose flatten concat
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from tasks.synth.dims import evaluate
from tasks.synth.graph import Graph
from tasks.synth.ops import activation, conv, elementwise, layout, matmul, normalisation, pooling, reduction
from tasks.synth.ops.base import Op
from tasks.synth.sizes import Cost

FAMILIES = ("elementwise", "activation", "reduction", "normalisation", "matmul", "conv", "pooling", "layout")
# How often the sampler reaches for a family relative to the others: layout ops only connect.
FAMILY_WEIGHT = {f: (0.5 if f == "layout" else 1.0) for f in FAMILIES}

REGISTRY: dict[str, Op] = {
    op.name: op
    for module in (elementwise, activation, reduction, normalisation, matmul, conv, pooling, layout)
    for op in module.OPS
}


class OpSelectionError(ValueError):
    """An `--ops` entry names neither a family nor an op."""


def resolve_ops(names: Sequence[str] | None) -> tuple[Op, ...]:
    """The sampled ops selected by family and op names (all of them when `names` is empty), in
    registry order."""
    if not names:
        return tuple(op for op in REGISTRY.values() if op.sampled)
    chosen: set[str] = set()
    for name in names:
        if name in FAMILIES:
            chosen |= {op.name for op in REGISTRY.values() if op.family == name and op.sampled}
        elif name in REGISTRY and REGISTRY[name].sampled:
            chosen.add(name)
        else:
            raise OpSelectionError(
                f"unknown op or family {name!r} (families: {', '.join(FAMILIES)}; "
                f"ops: {', '.join(n for n, op in REGISTRY.items() if op.sampled)})"
            )
    return tuple(op for op in REGISTRY.values() if op.name in chosen)


def graph_cost(graph: Graph, values: dict[int, int]) -> Cost:
    """Estimated flops and float32 bytes (every value and parameter) under one size assignment."""

    def extent(d) -> int:
        return d if isinstance(d, int) else evaluate(d, values)

    def shape(vid: int) -> tuple[int, ...]:
        return tuple(extent(d) for d in graph.values[vid].shape)

    flops = sum(REGISTRY[n.op].flops(n, shape) for n in graph.nodes)
    sizes = [prod(shape(v.id)) for v in graph.values]
    elements = sum(sizes) + sum(prod(extent(d) for d in p) for n in graph.nodes for p in REGISTRY[n.op].params(n))
    return Cost(flops=int(flops), bytes=4 * int(elements), largest=max(sizes))
