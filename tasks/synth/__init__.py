"""`kiln tasks synth`: KernelBench-format tasks from random operator graphs.

sampler.py     grow a random DAG of ops (NNSmith-style incremental insertion)
ops/           the op families: shape rules, PyTorch source, cost (one module per family)
dims.py        symbolic dimensions; sizes.py  the size constants and their per-shape values
graph.py       values, nodes, pruning; builder.py  the graph as ops see it while inserting
canonical.py   the canonical graph hash (dedup); levels.py  the level rule
emit.py        the task file; checks.py  the CPU checks; decontam.py  --exclude matching
generate.py    the loop that ties them together and writes the output directory
gpu_check.py   maintainer tool: time the references at their primary shapes on a GPU
"""

from tasks.synth.generate import SynthConfig, SynthError, SynthReport, WrittenTask, synthesize

__all__ = ["SynthConfig", "SynthError", "SynthReport", "WrittenTask", "synthesize"]
