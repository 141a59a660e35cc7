"""The replay actor: task feed with admission control, durable episode intake, PrimeEcho rewards,
group advantages, staleness filtering, Buffered Dynamic Retry and learner batches (docs/replay.md).
See docs/replay.md.

Modules: `formulas` (pure formulas), `task_source` (task sources and the split), `task_feed`,
`retry_buffer`, `groups`, `intake`, `ledger`, `packing`, `state` (the deterministic state machine),
`storage` (write-ahead log and snapshots), `actor` (the ReplayActor), `health` (its typed health
record), `offline` (the train-only replay), `examples` (an example task-source plug-in). The rollout
side of the episode contract, `EpisodeSender`, lives in `protocols.episodes`.
"""

from actors.buffer.actor import ReplayActor

__all__ = ["ReplayActor"]
