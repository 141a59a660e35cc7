"""Offline replay for `kiln train --train-only`: train on episodes saved by `--rollout-only`.

The episode log is what rollout actors write with `episode_log=` set: one file per actor, each a
sequence of length-prefixed `protocols.encode(Episode)` frames (`protocols.episodes.EpisodeLog`). `OfflineReplayActor`
reads them, groups the episodes by group id, judges every complete group with the same rules as the
live replay (PrimeEcho rewards, per-turn or per-episode advantages, tied and infra groups filtered), and serves the
learner's `BatchRequest`s with `batch_groups` groups per batch, in order, over the same
request/reply channel as `ReplayActor`, registered under the same name. Staleness does not apply:
every sample is from the saved weights, which is the point of the mode (exercise the learner alone on
a fixed input). It has no task set, so it serves no TaskListRequest (a train-only run has no warm
start and no evaluation).
"""

from __future__ import annotations

import logging
from pathlib import Path

from actors.base import Actor, RunContext
from actors.buffer.groups import Group, judge, turns_with_own_credit
from actors.buffer.health import GroupCounts, ReplayHealth
from actors.buffer.packing import pack_batch
from configs import AlgoConfig
from protocols import BatchReply, BatchRequest, Episode, ErrorReply, Record, VersionsSeen, VersionsSeenRequest
from protocols.channels import ReplyServer
from protocols.episodes import EpisodeLog

log = logging.getLogger(__name__)


def offline_batches(episodes: list[Episode], algo: AlgoConfig) -> tuple[list[list[Group]], dict[str, int]]:
    """Complete, trainable groups in batches of `algo.batch_groups`, and counts of what was dropped."""
    groups: dict[str, Group] = {}
    for ep in episodes:
        g = groups.setdefault(
            ep.group_id, Group(group_id=ep.group_id, task=ep.task, size=algo.group_size, last_activity=0.0)
        )
        g.episodes.setdefault(ep.sample_index, ep)
    dropped = {"incomplete": 0, "infra": 0, "tied": 0}
    ready = []
    for g in groups.values():
        if not g.complete:
            dropped["incomplete"] += 1
            continue
        verdict = judge(g, algo)
        if verdict.infra or verdict.tied:
            dropped["infra" if verdict.infra else "tied"] += 1
            continue
        g.advantages = verdict.advantages
        ready.append(g)
    batches = [
        ready[i : i + algo.batch_groups] for i in range(0, len(ready) - algo.batch_groups + 1, algo.batch_groups)
    ]
    return batches, dropped


class OfflineReplayActor(Actor):
    role = "replay"

    def __init__(self, episodes: str | Path, algo: AlgoConfig, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.algo, self.ctx = algo, ctx
        files = sorted(Path(episodes).glob("*.kiln")) if Path(episodes).is_dir() else [Path(episodes)]
        eps = [ep for f in files for ep in EpisodeLog.read(f)]
        self.batches, self.dropped = offline_batches(eps, algo)
        if not self.batches:
            raise ValueError(
                f"{episodes}: no complete, untied group of {algo.group_size} episodes to train on "
                f"({len(eps)} episodes read; dropped groups {self.dropped})"
            )
        self.episodes = len(eps)
        self.served = 0
        self.turn_credited_turns = 0  # as the live replay counts it, over the batches served
        self._server: ReplyServer | None = None
        log.info(
            "offline replay: %d episodes, %d batches, dropped groups %s", len(eps), len(self.batches), self.dropped
        )

    def start(self) -> dict[str, str]:
        b = self.ctx.bind
        self._server = ReplyServer(b.host, b.transport, b.advertise)
        self.spawn(lambda: self._server.serve(self.handle, self._stop), "serve")
        self.ctx.registry.register(self.ctx.name or "replay", self.role, {"replay": self._server.address})
        return {"replay": self._server.address}

    def stop(self) -> None:
        super().stop()
        if self._server is not None:
            self._server.close()

    def handle(self, rec: Record) -> Record:
        if isinstance(rec, VersionsSeenRequest):  # only the saved weights made these episodes
            return VersionsSeen(highest=0)
        if not isinstance(rec, BatchRequest):
            return ErrorReply(
                message=f"offline replay serves BatchRequest and VersionsSeenRequest, not {type(rec).__name__}"
            )
        index = rec.version % len(self.batches)  # more steps than batches: go round again
        if rec.version >= self.algo.total_steps:
            return BatchReply(status="stop")
        self.served += 1
        groups = self.batches[index]
        episodes = [ep for g in groups for ep in g.ordered()]
        self.turn_credited_turns += sum(turns_with_own_credit(ep, self.algo) for ep in episodes)
        return BatchReply(
            status="batch",
            batch=pack_batch(episodes, [a for g in groups for a in g.advantages], rec.version, self.algo.train_turns),
        )

    def health(self) -> ReplayHealth:
        n = self.episodes
        return ReplayHealth(
            role=self.role,
            alive=not self.stopping,
            looping=self.threads_running,
            address=self._server.address if self._server else "",
            emitted=n,
            pending=n,
            groups=GroupCounts(ready=len(self.batches)),
            batches=self.served,
            turn_credited_turns=self.turn_credited_turns,
        )
