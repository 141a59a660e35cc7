"""Data parallelism shared by the learner backends: which micro-batches a DP rank trains, and the
sums over DP ranks that keep a step's normalizer and statistics those of the whole batch.

Every DP rank receives the same TrainBatch and derives the same split from it, so no rank needs to
be told its share. Each rank computes log π_prox, MirrorPop and the loss on its own sequences only
(whole sequences never straddle micro-batches), then the gradient-carrying token count, the loss
and the filter statistics are summed over DP: the normalizer of every rank's loss is the batch's.
`group=None` is the default process group (the torch backend's DP ranks are the whole world).
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from actors.learner.batch import MicroBatch
from actors.learner.losses import PolicyStats

_EXTREMES = ("is_weight_max", "is_weight_min")


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


def owned_positions(num_tokens: int, mine: list[MicroBatch], device: torch.device) -> torch.Tensor:
    """Boolean [num_tokens]: the positions of this rank's micro-batches."""
    own = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for mb in mine:
        own[mb.positions] = True
    return own


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

    def stats(self, stats: PolicyStats) -> PolicyStats:
        """Counts and sums added over ranks; the importance-weight extremes are the ranks' max/min."""
        if self.size == 1:
            return stats
        names = [f.name for f in fields(PolicyStats) if f.name not in _EXTREMES]
        sums = torch.tensor([float(getattr(stats, n)) for n in names], dtype=torch.float64, device=self.device)
        extremes = torch.tensor([stats.is_weight_max, -stats.is_weight_min], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        merged = {n: (int(v) if isinstance(getattr(stats, n), int) else float(v)) for n, v in zip(names, sums.tolist())}
        return PolicyStats(**merged, is_weight_max=float(extremes[0]), is_weight_min=-float(extremes[1]))

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
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
