"""The `gloo` transport: a gloo process group per engine, for learners and engines on CPU (the tests,
CPU runs), and what `learner.weight_sync: auto` picks for a CPU learner. A gloo broadcast to a dead
peer cannot be aborted: it ends at the group's timeout, which is why a push never waits on a group
the server has dropped (see `group.GroupSender.push`)."""

from __future__ import annotations

from actors.policy.weights.group import GroupLoader, GroupSender


class GlooSender(GroupSender):
    name = "gloo"


class GlooLoader(GroupLoader):
    name = "gloo"
