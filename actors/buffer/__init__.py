"""The replay actor: task feed with admission control, durable episode intake, PrimeEcho rewards,
group advantages, staleness filtering, Buffered Dynamic Retry and learner batches (DESIGN.md §6).
See docs/replay.md.

Modules: `formulas` (pure formulas), `task_source` (task sources and the split), `task_feed`,
`retry_buffer`, `groups`, `intake`, `ledger`, `packing`, `state` (the deterministic state machine),
`storage` (write-ahead log and snapshots), `actor` (the ReplayActor), `health` (its typed health
record), `offline` (the train-only replay), `sender` (the rollout side of
the episode contract), `synthetic` (valid fake episodes), `simulation` (the staleness simulation),
`examples` (an example task-source plug-in).
"""

from actors.buffer.actor import ReplayActor
from actors.buffer.sender import EpisodeSender

__all__ = ["EpisodeSender", "ReplayActor"]
