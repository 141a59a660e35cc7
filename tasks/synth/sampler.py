"""Random operator graphs, grown one op at a time (NNSmith's incremental construction, with concrete
multi-environment shape checking in place of an SMT solver).

A graph starts from one input whose layout suits the first drawn op. Each step draws a family
(weighted), an op of it, and a first operand: usually the newest value (the graph grows as a chain),
sometimes an earlier one (a side branch). Binary ops take their second operand preferably from the
values nothing consumes yet, which joins side branches back (residuals, gates, attention-like
products), else from any shape-compatible value, else from a fresh input. An op that declines its
operand, or whose shapes fall below 1 in some environment, is rolled back and another is drawn.
At the end the graph is cut down to what the newest value needs, and `fit_sizes` shrinks each
environment's sizes into its budget.
"""

from __future__ import annotations

from random import Random

from tasks.synth.builder import Builder
from tasks.synth.graph import Graph, prune
from tasks.synth.ops import FAMILY_WEIGHT, REGISTRY, graph_cost
from tasks.synth.ops.base import Op
from tasks.synth.sizes import ENVS, fit

LAYOUT_WEIGHT = {"rows": 3, "seq": 3, "signal": 2, "image": 2}
TRIES_PER_OP = 16  # attempts per wanted op before the sampler settles for a smaller graph


def draw_op(rng: Random, ops: tuple[Op, ...]) -> Op:
    families = sorted({op.family for op in ops}, key=list(FAMILY_WEIGHT).index)
    family = rng.choices(families, weights=[FAMILY_WEIGHT[f] for f in families])[0]
    members = [op for op in ops if op.family == family]
    return members[rng.randrange(len(members))]


def sample_graph(rng: Random, ops: tuple[Op, ...], max_ops: int) -> Graph | None:
    """A graph of 1..max_ops nodes drawn from `ops`, or None when it ended with no compute op (only
    layout ops)."""
    target = rng.randint(1, max_ops)
    b = Builder(rng)
    first = draw_op(rng, ops)
    layouts = list(first.layouts)
    head = b.input_of_layout(rng.choices(layouts, weights=[LAYOUT_WEIGHT[lay] for lay in layouts])[0])
    pending: Op | None = first
    for _ in range(TRIES_PER_OP * target):
        live = len(b.graph.ancestry(head.id)[0])
        if live >= target:
            break
        op, pending = pending or draw_op(rng, ops), None
        if op.node_count > target - live:
            continue
        floats = b.floats()
        x = head if rng.random() < 0.8 else floats[rng.randrange(len(floats))]
        mark = b.mark()
        out = op.build(b, x)
        if out is None or not b.graph.valid_everywhere():
            b.rollback(mark)
            continue
        head = out
    graph = prune(b.graph, head.id)
    if all(REGISTRY[n.op].family == "layout" for n in graph.nodes):
        return None
    return graph


def fit_sizes(graph: Graph) -> bool:
    """Shrink each environment's sizes into its budget; False when some environment cannot fit."""
    return all(fit(graph.sizes, env, lambda values: graph_cost(graph, values), graph.dims_valid) for env in ENVS)
