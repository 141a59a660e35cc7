"""What a rollout actor tells the driver and the disk about its groups, apart from replay.

`group_report` condenses one finished group into a `GroupReport` (turn scores and passes, verifier
stages and error classes, compiled source hashes, tokens, time) for the live view and the report.
`Reporter` pushes those, plus the group's episodes for the readable dumps, to the driver's metrics
socket (best effort: the driver being slow or gone never stalls rollouts), and appends every episode
to an `EpisodeLog` in rollout-only mode. The driver needs a whole group to show an episode's
advantage, and whichever episode turns out to show a mechanism (a MirrorPop drop is known only at
the learner's step), so it gets every episode and keeps the last few steps' worth.
"""

from __future__ import annotations

import logging

from protocols import Episode, GroupReport, TaskReply
from protocols.channels import PushChannel
from protocols.episodes import EpisodeLog

log = logging.getLogger(__name__)


def group_report(actor_id: str, reply: TaskReply, episodes: list[Episode], seconds: float) -> GroupReport:
    results = [t.result for ep in episodes for t in ep.turns if t.result is not None]
    return GroupReport(
        actor_id=actor_id,
        group_id=reply.group_id,
        task_id=reply.task.task_id,
        is_retry=reply.task.repair is not None,
        turn_scores=[[float(s) for s in ep.rewards] for ep in episodes],
        turn_passed=[[bool(t.result is not None and t.result.passed) for t in ep.turns] for ep in episodes],
        stages=[r.stage for r in results],
        error_classes=[r.error_class for r in results if r.error_class],
        # Compiled sources: attempts that got past extraction into the compile stage.
        source_hashes=[r.source_hash for r in results if r.source_hash and r.stage != "extract"],
        generated_tokens=sum(len(t.response_ids) for ep in episodes for t in ep.turns),
        seconds=seconds,
    )


class Reporter:
    def __init__(self, metrics: str | None, *, send_episodes: bool, episode_log: str | None) -> None:
        self._push = PushChannel(metrics) if metrics else None
        self._send_episodes = send_episodes
        self._log = EpisodeLog(episode_log) if episode_log else None
        self.dropped = 0

    def group(self, report: GroupReport, episodes: list[Episode]) -> None:
        if self._log is not None:
            for ep in episodes:
                self._log.append(ep)
        if self._push is None:
            return
        records = [report] + (list(episodes) if self._send_episodes else [])
        for rec in records:
            try:
                self._push.send(rec, timeout_s=0.5)
            except Exception as err:  # noqa: BLE001 - observability must never stall or kill a rollout
                self.dropped += 1
                log.debug("report push failed: %s", err)

    def close(self) -> None:
        if self._push is not None:
            self._push.close()
        if self._log is not None:
            self._log.close()
