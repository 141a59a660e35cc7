"""Task sources (built-in directory, plug-ins by dotted path, bad plug-ins), the train/validation
split, and the task feed's admission control through the real replay actor."""

from __future__ import annotations

import dataclasses

import pytest

from actors.base import RunContext
from actors.buffer import ReplayActor
from actors.buffer.examples import TextMatchTasks
from actors.buffer.health import Admission
from actors.buffer.task_source import is_validation, load_task_set
from configs import AlgoConfig, ConfigError, ReplayConfig, load_config
from protocols import (
    BatchRequest,
    ErrorReply,
    Task,
    TaskList,
    TaskListRequest,
    TaskRequest,
    VersionsSeen,
    VersionsSeenRequest,
)
from tasks.loader import SHIPPED, discover
from tests.helpers.synthetic import TurnSpec, make_episode

TEXT = "actors.buffer.examples.TextMatchTasks"


# plug-ins for the contract tests, named by dotted path like any user's plug-in
class RaisingSource:
    def __init__(self, cfg, backend):
        raise RuntimeError("no credentials for the task store")

    def tasks(self):
        return []


class DictSource:
    def __init__(self, cfg, backend):
        pass

    def tasks(self):
        return [{"task_id": "a", "kind": "text_match"}]


class EmptySource(DictSource):
    def tasks(self):
        return []


class DuplicateSource(DictSource):
    def tasks(self):
        t = Task(task_id="same", kind="text_match", payload={"prompt": "p", "answer": "a"})
        return [t, t]


def here(name: str) -> str:
    return f"{__name__}.{name}"


# ---------------------------------------------------------------------------------- task sources


def test_builtin_source_loads_the_shipped_kernel_tasks(tmp_path, monkeypatch):
    ts = load_task_set(ReplayConfig(tasks=str(SHIPPED), val_fraction=0.25), "cpu")
    tasks = ts.train + ts.val
    assert sorted(t.task_id for t in tasks) == sorted(tf.task_id for tf in discover(SHIPPED))
    assert all(t.kind == "kernel" and t.kernel.backend == "cpu" for t in tasks)
    # the relative default 'tasks' names the shipped set even when the working directory is elsewhere
    monkeypatch.chdir(tmp_path)
    elsewhere = load_task_set(ReplayConfig(tasks="tasks", val_fraction=0.25), "cpu")
    assert [t.task_id for t in elsewhere.train] == [t.task_id for t in ts.train]


def test_example_plugin_loads_by_dotted_path():
    ts = load_task_set(ReplayConfig(task_source=TEXT, val_fraction=0.1, split_seed=7), "cpu")
    tasks = ts.train + ts.val
    assert len(tasks) == 300 and len({t.task_id for t in tasks}) == 300
    assert all(t.kind == "text_match" and t.kernel is None for t in tasks)
    by_id = {t.task_id: t.payload for t in tasks}
    word = TextMatchTasks(ReplayConfig(), "cpu").words[0]
    assert by_id[f"text/repeat/{word}"] == {"prompt": f"Repeat: {word}\n", "answer": word}
    assert by_id[f"text/reverse/{word}"]["answer"] == word[::-1]
    assert by_id[f"text/upper/{word}"]["answer"] == word.upper()


@pytest.mark.parametrize(
    "path, message",
    [
        ("nodots", "not a dotted path"),
        ("no_such_module_xyz.Source", "cannot import module"),
        ("actors.buffer.examples.NoSuchClass", "has no attribute 'NoSuchClass'"),
        ("actors.buffer.examples.KIND", "names a str, not a class"),
        (here("RaisingSource"), "constructing it raised RuntimeError: no credentials"),
        (here("DictSource"), "item 0 is a dict, not a protocols.Task"),
        (here("EmptySource"), "non-empty list"),
        (here("DuplicateSource"), "task id 'same' appears twice"),
    ],
)
def test_bad_task_sources_are_config_errors_at_startup(path, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        ReplayActor(ReplayConfig(task_source=path), AlgoConfig(), RunContext(run_dir=str(tmp_path)))


def test_bad_task_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="replay.tasks"):
        load_task_set(ReplayConfig(tasks=str(tmp_path / "missing")), "cpu")
    (tmp_path / "notes.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no KernelBench-format reference"):
        load_task_set(ReplayConfig(tasks=str(tmp_path)), "cpu")


def test_group_size_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        ReplayActor(ReplayConfig(task_source=TEXT), AlgoConfig(group_size=1), RunContext(run_dir=str(tmp_path)))


def test_schema_accepts_a_dotted_task_source():
    cfg = load_config(None, [f"replay.task_source={TEXT}", "replay.snapshot_every=5"])
    assert cfg.replay.task_source == TEXT and cfg.replay.snapshot_every == 5


# ----------------------------------------------------------------------------------------- split


def test_split_is_deterministic_by_seed_and_task_id():
    a = load_task_set(ReplayConfig(task_source=TEXT, val_fraction=0.2, split_seed=1), "cpu")
    b = load_task_set(ReplayConfig(task_source=TEXT, val_fraction=0.2, split_seed=1), "cpu")
    c = load_task_set(ReplayConfig(task_source=TEXT, val_fraction=0.2, split_seed=2), "cpu")
    ids = lambda ts: {t.task_id for t in ts}
    assert ids(a.val) == ids(b.val) and ids(a.val) != ids(c.val)
    assert not ids(a.train) & ids(a.val) and len(a.train) + len(a.val) == 300
    assert 30 <= len(a.val) <= 90  # ~20 % of 300
    assert all(t.split == "val" for t in a.val) and all(t.split == "train" for t in a.train)
    assert {t.task_id for t in a.val} == {t.task_id for t in a.train + a.val if is_validation(t.task_id, 1, 0.2)}
    assert not load_task_set(ReplayConfig(task_source=TEXT, val_fraction=0.0), "cpu").val


def test_a_split_without_training_tasks_is_refused():
    with pytest.raises(ConfigError, match="no training task"):
        load_task_set(
            ReplayConfig(tasks=str(SHIPPED / "level1" / "01_relu.py"), val_fraction=0.99, split_seed=3), "cpu"
        )


# -------------------------------------------------------------------------- feed through the actor


@pytest.fixture
def make_actor(tmp_path):
    made = []

    def make(*, max_staleness=1, **kw):
        algo = AlgoConfig(
            **{
                "group_size": 2,
                "batch_groups": 2,
                "total_steps": 3,
                "max_staleness": max_staleness,
                **kw.pop("algo", {}),
            }
        )
        a = ReplayActor(
            ReplayConfig(task_source=TEXT, **kw), algo, RunContext(run_dir=str(tmp_path / f"run{len(made)}"))
        )
        made.append(a)
        return a

    yield make
    for a in made:
        a.stop()


def fill(actor, reply, scores=(1.0, -1.0), version=0):
    for i, s in enumerate(scores):
        ep = make_episode(reply.task, reply.group_id, i, [TurnSpec(passed=s > 0, score=s, version=version)])
        assert actor.handle(ep).status == "stored"


def test_admission_bound_counts_groups_and_opens_with_the_learner_version(make_actor):
    a = make_actor(max_staleness=1, retry_after_s=0.3)  # B = 2: (η + v + 1)·B = 4 groups at v = 0
    replies = [a.handle(TaskRequest(actor_id="r")) for _ in range(5)]
    assert [r.status for r in replies] == ["task"] * 4 + ["wait"]
    assert replies[4].retry_after_s == 0.3
    assert a.health().admission == Admission(admitted=4, limit=4, waits=1, running=4, window=4)
    for r in replies[:2]:
        fill(a, r)
    assert a.handle(BatchRequest(learner_id="l", version=0)).status == "batch"
    assert a.handle(TaskRequest(actor_id="r")).status == "wait"  # trained groups stay accepted
    assert a.handle(BatchRequest(learner_id="l", version=1)).status == "wait"
    assert [a.handle(TaskRequest(actor_id="r")).status for _ in range(3)] == ["task", "task", "wait"]


def test_groups_filtered_by_their_verdict_widen_the_running_window(make_actor):
    # B = 2 at η = 0: a plain window of 2 groups. Both tie: the share kept falls to its floor (1/8), and
    # the window's 2 places count the running groups at 1/8 each.
    a = make_actor(max_staleness=0, min_keep_rate=0.125)
    first = [a.handle(TaskRequest(actor_id="r")) for _ in range(3)]
    assert [r.status for r in first] == ["task", "task", "wait"]
    for r in first[:2]:
        fill(a, r, scores=(-1.0, -1.0))
    assert a.health().admission == Admission(admitted=0, limit=2, waits=1, running=0, window=16, keep_rate=0.125)
    assert [a.handle(TaskRequest(actor_id="r")).status for _ in range(17)] == ["task"] * 16 + ["wait"]


def test_whole_run_admission_hands_out_the_run_without_a_learner(make_actor):
    # rollout-only runs: no learner advances v, so the bound is the run's total_steps·B groups, not η
    a = make_actor(max_staleness=0, admission="whole_run", algo={"total_steps": 3, "batch_groups": 2})
    assert [a.handle(TaskRequest(actor_id="r")).status for _ in range(7)] == ["task"] * 6 + ["wait"]
    assert a.health().admission == Admission(admitted=6, limit=6, waits=1, running=6, window=6)


def test_task_lists_and_versions_seen_answer_without_changing_the_state(make_actor):
    a = make_actor(val_fraction=0.25)
    train, val = a.handle(TaskListRequest(split="train")), a.handle(TaskListRequest(split="val"))
    assert isinstance(train, TaskList) and isinstance(val, TaskList) and train.tasks and val.tasks
    assert {t.split for t in train.tasks} == {"train"} and {t.split for t in val.tasks} == {"val"}
    assert not {t.task_id for t in train.tasks} & {t.task_id for t in val.tasks}
    assert a.handle(VersionsSeenRequest(learner_id="l")) == VersionsSeen(highest=0)
    r = a.handle(TaskRequest(actor_id="r"))
    fill(a, r, version=0)
    a.handle(BatchRequest(learner_id="l", version=2))
    assert a.handle(VersionsSeenRequest(learner_id="l")).highest == 2
    assert a.health().groups.issued == 1  # the lists handed out no group


def test_tied_groups_free_their_slot_without_reissue(make_actor):
    a = make_actor(max_staleness=0)
    r1, r2 = a.handle(TaskRequest(actor_id="r")), a.handle(TaskRequest(actor_id="r"))
    assert a.handle(TaskRequest(actor_id="r")).status == "wait"
    fill(a, r1, scores=(-1.0, -1.0))  # all tie: no learning signal
    h = a.health()
    assert h.filtered == {"tied": 2} and h.groups.filtered == {"tied": 1}
    r3 = a.handle(TaskRequest(actor_id="r"))
    assert r3.status == "task" and r3.task.task_id not in (r1.task.task_id, r2.task.task_id)


def test_with_dynamic_sampling_off_tied_groups_are_trained(make_actor):
    a = make_actor(max_staleness=0, algo={"drop_tied_groups": False, "batch_groups": 1})
    fill(a, a.handle(TaskRequest(actor_id="r")), scores=(-1.0, -1.0))
    h = a.health()
    assert h.filtered == {} and h.groups.ready == 1  # no signal, but trainable: the learner steps on
    batch = a.handle(BatchRequest(learner_id="l", version=0)).batch
    assert batch.advantages.tolist() == [0.0, 0.0]  # zero advantages: no policy gradient


def test_validation_tasks_only_on_request_and_outside_admission(make_actor):
    a = make_actor(val_fraction=0.1, max_staleness=0)
    val = [a.handle(TaskRequest(actor_id="eval", split="val")) for _ in range(3)]
    assert all(r.status == "task" and r.task.split == "val" for r in val)
    train = [a.handle(TaskRequest(actor_id="r")) for _ in range(2)]
    assert all(r.task.split == "train" for r in train)
    assert a.health().admission.admitted == 2
    assert a.handle(TaskRequest(actor_id="eval", split="val")).status == "task"  # even when training waits
    ep = make_episode(val[0].task, val[0].group_id, 0, [TurnSpec()])
    ack = a.handle(ep)
    assert ack.status == "rejected" and "validation" in ack.reason
    none = make_actor(val_fraction=0.0)
    assert isinstance(none.handle(TaskRequest(actor_id="eval", split="val")), ErrorReply)


def test_training_stops_at_total_steps(make_actor):
    a = make_actor(max_staleness=5, algo={"total_steps": 1, "batch_groups": 1})
    r = a.handle(TaskRequest(actor_id="r"))
    assert a.handle(TaskRequest(actor_id="r")).status == "wait"  # capped at total_steps·B groups
    fill(a, r)
    assert a.handle(BatchRequest(learner_id="l", version=0)).status == "batch"
    assert a.handle(BatchRequest(learner_id="l", version=1)).status == "stop"
    assert a.handle(TaskRequest(actor_id="r")).status == "stop"


# ------------------------------------------------------------------------- tasks leaving the feed


class ThreeTasks:
    """A plug-in task source whose constructor takes its own setting (replay.task_source_args)."""

    def __init__(self, cfg, backend, *, count: int):
        self.count = count

    def tasks(self):
        return [
            Task(task_id=f"t{i}", kind="text_match", payload={"prompt": f"p{i}", "answer": "a"})
            for i in range(self.count)
        ]


def three_task_actor(tmp_path, name="run", **replay):
    cfg = ReplayConfig(task_source=here("ThreeTasks"), task_source_args={"count": 3}, val_fraction=0.0, **replay)
    algo = AlgoConfig(group_size=2, batch_groups=1, total_steps=100)
    return ReplayActor(cfg, algo, RunContext(run_dir=str(tmp_path / name)))


def test_task_source_args_reach_the_plugin_constructor(tmp_path):
    args = {"count": 5}
    ts = load_task_set(ReplayConfig(task_source=here("ThreeTasks"), task_source_args=args, val_fraction=0.0), "cpu")
    assert [t.task_id for t in ts.train] == [f"t{i}" for i in range(5)]
    with pytest.raises(ConfigError, match="unexpected keyword argument 'cuont'"):
        load_task_set(ReplayConfig(task_source=here("ThreeTasks"), task_source_args={"cuont": 5}), "cpu")


def test_an_unservable_task_leaves_the_feed_once_and_for_good(tmp_path, caplog):
    actor = three_task_actor(tmp_path)
    try:
        reply = actor.handle(TaskRequest(actor_id="r"))
        gone = reply.task.task_id
        for i in range(2):
            ep = make_episode(reply.task, reply.group_id, i, [TurnSpec(infra=True, prompt_len=0, response_len=0)])
            ep = dataclasses.replace(ep, unservable="its first prompt is 9000 tokens; ... exceeds model.max_seq_len")
            assert actor.handle(ep).status == "stored"
        h = actor.health()
        assert h.feed.dropped == {"unservable": 1} and h.filtered == {"unservable": 2} and h.invariant_ok
        assert sum("leaves the task feed" in r.message and gone in r.message for r in caplog.records) == 1
        served = []
        for _ in range(8):  # two epochs of the other two tasks, never the one that left
            r = actor.handle(TaskRequest(actor_id="r"))
            served.append(r.task.task_id)
            fill(actor, r, scores=(1.0, -1.0))
            actor.handle(BatchRequest(learner_id="l", version=len(served) - 1))
        assert gone not in served and set(served) == {"t0", "t1", "t2"} - {gone}
    finally:
        actor.stop()
    restarted = three_task_actor(tmp_path)  # the decision is durable: a restarted replay keeps it
    try:
        assert restarted.health().feed.dropped == {"unservable": 1}
        assert restarted.handle(TaskRequest(actor_id="r")).task.task_id != gone
    finally:
        restarted.stop()


def test_a_task_whose_groups_keep_failing_as_infra_leaves_after_infra_retries(tmp_path):
    actor = three_task_actor(tmp_path, infra_retries=2)
    try:

        def infra_group():
            r = actor.handle(TaskRequest(actor_id="r"))
            for i in range(2):
                actor.handle(make_episode(r.task, r.group_id, i, [TurnSpec(infra=True)]))
            return r.task.task_id

        first = infra_group()
        assert actor.health().feed.reissue_queue == 1 and not actor.health().feed.dropped
        assert infra_group() == first  # re-issued at the front, and infra again: out
        h = actor.health()
        assert h.feed.dropped == {"infra": 1} and h.feed.reissue_queue == 0 and h.filtered == {"infra": 4}
        left = {actor.handle(TaskRequest(actor_id="r")).task.task_id for _ in range(2)}
        assert first not in left and len(left) == 2
    finally:
        actor.stop()


def test_when_every_task_has_left_the_feed_it_says_so(tmp_path):
    cfg = ReplayConfig(task_source=here("ThreeTasks"), task_source_args={"count": 1}, val_fraction=0.0)
    actor = ReplayActor(cfg, AlgoConfig(group_size=2, batch_groups=1), RunContext(run_dir=str(tmp_path)))
    try:
        r = actor.handle(TaskRequest(actor_id="r"))
        for i in range(2):
            ep = make_episode(r.task, r.group_id, i, [TurnSpec(infra=True)])
            actor.handle(dataclasses.replace(ep, unservable="no payload['prompt']"))
        answer = actor.handle(TaskRequest(actor_id="r"))
        assert isinstance(answer, ErrorReply) and "every training task has left the task feed" in answer.message
    finally:
        actor.stop()
