"""How many compile processes a verifier runs when `verifier.compile_workers` is 0 (auto): the cores
of its node that its process may use, shared by the run's verifier actors on that node. Compiles are
CPU work apart from the GPU execution, so they scale with the node's cores, not with its GPUs."""

from __future__ import annotations

import os


def node_compile_workers(verifiers_on_node: int = 1) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, verifiers_on_node))
