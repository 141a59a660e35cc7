"""Data parallelism shared by the learner backends: which micro-batches a DP rank trains, and the
sums over DP ranks.

Every DP rank receives the same TrainBatch and derives the same split from it, so no rank needs to
be told its share. The RL step (actors.learner.algorithm) splits each pass over the batch (π_prox,
each mini-batch's update) into micro-batches and gives every rank its share; per-position results
(log π_prox) are summed so that every rank holds them whole, losses and counts are summed, and the
gradients are summed before each optimizer step, so the ranks take identical steps.
`group=None` is the default process group (the torch backend's DP ranks are the whole world).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from actors.learner.batch import MicroBatch


def assign_micro_batches(micros: list[MicroBatch], dp: int, dp_rank: int) -> list[MicroBatch]:
    """This DP rank's micro-batches: largest first to the least-loaded rank (ties: lowest rank), so
    every rank derives the same split from the same batch. Order within a rank follows the batch."""
    loads = [0] * dp
    owner: dict[int, int] = {}
    for i in sorted(range(len(micros)), key=lambda i: (-(micros[i].stop - micros[i].start), i)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += micros[i].stop - micros[i].start
    return [mb for i, mb in enumerate(micros) if owner[i] == dp_rank]


class DataParallel:
    """Sums over the DP ranks of one group (a no-op for a group of one)."""

    def __init__(self, size: int, rank: int, group=None, device: str | torch.device = "cpu") -> None:
        self.size, self.rank, self.group = size, rank, group
        self.device = torch.device(device)

    def sum(self, value: float) -> float:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """In place; for position-aligned results each rank filled only its own positions of."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def sum_all(self, values: list[float]) -> list[float]:
        """Several sums in one all-reduce."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Add every parameter's gradient over the ranks (one flat all-reduce). A rank that had no
        micro-batch with kept tokens contributes zeros."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
