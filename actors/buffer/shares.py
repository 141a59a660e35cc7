"""Each rollout actor's share of the admission window (docs/replay.md, "Admission shares").

Admission control bounds the groups running over all rollout actors together. Left at that, groups
go first come, first served: the first actor to ask after a new version takes every group it has
room for (its in-flight budget is usually larger than the window), so the step's groups pile onto
one engine while the others idle, and all of them are lost if that actor dies. The share caps what
one actor holds at once at ceil(window / active actors) (`actors.decisions.share_room`), where the
window is the groups that may be running now. This module keeps the books the share needs: an actor
is active while it holds a running group or has asked for one lately; a dead actor's release makes it
inactive at once, so the survivors take its groups.

It only ever says "wait" (an answer that changes nothing and is not logged), so a restart's
re-application of the logged requests, all of which were admitted, never consults it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from actors import decisions

ACTIVE_FOR_RETRIES = 5  # an actor holding nothing stays active this many retry intervals after it last asked


@dataclass
class AdmissionShares:
    idle_s: float  # an actor that holds nothing and has not asked for this long is not counted
    asked: dict[str, float] = field(default_factory=dict)  # actor id -> when it last asked for a task

    @classmethod
    def for_retry_interval(cls, retry_after_s: float) -> AdmissionShares:
        """Waiting actors ask again every `retry_after_s`; a few missed asks mean it is gone."""
        return cls(idle_s=ACTIVE_FOR_RETRIES * retry_after_s)

    def room(self, actor_id: str, held: Mapping[str, int], window: int, group_size: int, now: float) -> int:
        """Attempts `actor_id`, which asks now, may still start under its share. `held`: running groups
        per actor; `window`: the groups that may be running at once now."""
        self.asked[actor_id] = now
        active = {a for a, t in self.asked.items() if now - t <= self.idle_s}
        active |= {a for a, n in held.items() if n > 0}
        return decisions.share_room(held.get(actor_id, 0), window, len(active), group_size)

    def release(self, actor_id: str) -> None:
        """`actor_id` died: not active until it asks again (its replacement does, under the same id)."""
        self.asked.pop(actor_id, None)
