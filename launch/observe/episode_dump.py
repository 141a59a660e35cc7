"""Readable episode dumps: `run_dir/episodes/step-000012.txt`, a few episodes per learner step, each as
the conversation the policy had, so a person can read what it wrote, what the verifier said about
it and what the algorithm made of it.

An episode reads as its turns, each with its prompt as the chat template rendered it (role markers and
all; a later turn shows only what it adds to the earlier prompt: the earlier answer as an assistant
turn and the feedback as a user turn), the answer (and its thinking), and the verdict with its stage,
error class, score and feedback. Then its reward terms: the score s of each turn, PrimeEcho's parts
(α·s_first, (1-α)·max s, b_early) and their sum R, the group's rewards and the advantage of each of
its gradient-carrying turns (one per turn with `algo.turn_credit=per_turn`, the episode's with `episode`);
then what happened to it: trained at a step with its lag, dropped by MirrorPop, or filtered with its
group as tied. The first prompt is long and repetitive (the rules, the reference code) and is cut in
the middle; answers are kept whole up to a generous limit, since a hack is in them.

`EpisodeDumper` holds the episodes the rollouts sent (every episode of a group, so an advantage can be
shown; a bounded number, the newest) and picks each step's dumps by kind: the best and the worst of
the new episodes, a retry, a filtered one (MirrorPop's, else a tied group's), up to
`logging.episodes_per_step`. The first episode to show each mechanism of the report's table
(launch/observe/mechanisms.py) is dumped too, whenever it comes, and at the session's end from episodes
that arrived after its last step (`step-000012-end.txt`); `episodes/index.jsonl` lists every dumped
episode with its file and tags, which is how the report points at it.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.buffer.formulas import early_bonus
from actors.buffer.groups import credit, episode_passed, episode_reward, turn_passed
from actors.buffer.packing import episode_lag
from configs import AlgoConfig
from launch.observe import mechanisms as mech
from protocols import ERROR_CLASSES, Episode, Turn, VerifyResult

log = logging.getLogger(__name__)

PROMPT_CHARS = 1500
RESPONSE_CHARS = 12000
FEEDBACK_CHARS = 2000
HELD_EPISODES = 512  # the newest episodes kept for the dumps (every episode of a group is sent)
INDEX = "index.jsonl"
FIRST_TO_SHOW = "first to show: "  # why an episode is dumped when it is the first to show a mechanism
# Verifier diagnostics worth a reader's eye: legality violations, vendor libraries, errors.
DIAGNOSTIC_KEYS = ("violations", "vendor_libs", "error", "max_abs_error")

Decode = Callable[[list[int]], str]


@dataclass
class _Held:
    """An episode the dumper holds, and what the learner's steps did with it."""

    episode: Episode
    fresh: bool = True  # not yet considered for a step's best / worst / retry / filtered picks
    trained: tuple[int, int] | None = None  # (step, lag) when a step trained on it
    dropped_at: int | None = None  # the step at which MirrorPop dropped it


@dataclass
class _Fate:
    """What a learner step did to an episode before the driver received it: the step's row (from the
    learner) and the episode (from its rollout actor) travel separately, so either may come first."""

    trained: tuple[int, int | None] | None = None  # (step, the version it trained for)
    dropped_at: int | None = None


@dataclass(frozen=True)
class RewardTerms:
    """An episode's reward, term by term, and its place in its group."""

    scores: list[float]  # s of each turn
    first: float  # α·s_first
    best: float  # (1-α)·max s
    bonus: float  # b_early
    reward: float  # R, their sum
    group_rewards: list[float] | None = None  # R of every sample of the group, when the whole group is held
    advantages: list[float] | None = None  # one per gradient-carrying turn, as replay credits them


@dataclass
class EpisodeDumper:
    run_dir: Path
    algo: AlgoConfig
    decode: Decode
    decode_prompt: Decode | None = None  # prompts with their chat markup (default: decode)
    per_step: int = 4
    held_limit: int = HELD_EPISODES
    _held: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    _shown: set = field(default_factory=set)  # mechanism tags some earlier dump shows
    _early: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # id -> _Fate, not held yet

    def __post_init__(self) -> None:
        self.dir = Path(self.run_dir) / "episodes"
        for row in read_index(self.run_dir):  # a resumed run: what is shown already stays shown
            self._shown.update(row["tags"])

    def add(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            held = self._held[ep.episode_id] = _Held(ep)
            self._held.move_to_end(ep.episode_id)
            fate = self._early.pop(ep.episode_id, None)
            if fate is not None:  # a step named it before it arrived
                if fate.trained is not None:
                    self._mark_trained(held, *fate.trained)
                held.dropped_at = fate.dropped_at
        while len(self._held) > self.held_limit:
            self._held.popitem(last=False)

    def learner_step(self, step: int, version: int | None, named: dict[str, list[str]]) -> None:
        """What the learner's step `step` (trained for weights `version`, the version before it) did.
        An episode not received yet gets its fate when it arrives."""
        for eid in named.get("trained", ()):
            held = self._held.get(eid)
            if held is not None:
                self._mark_trained(held, step, version)
            else:
                self._fate(eid).trained = (step, version)
        for eid in named.get("mirrorpop_dropped", ()):
            if eid in self._held:
                self._held[eid].dropped_at = step
            else:
                self._fate(eid).dropped_at = step

    def _mark_trained(self, held: _Held, step: int, version: int | None) -> None:
        lag = episode_lag(held.episode, version, self.algo.train_turns) if version is not None else None
        held.trained = (step, lag if lag is not None else 0)

    def _fate(self, episode_id: str) -> _Fate:
        fate = self._early.setdefault(episode_id, _Fate())
        while len(self._early) > self.held_limit:  # episodes that never come (the driver saw none of them)
            self._early.popitem(last=False)
        return fate

    def dump(self, step: int) -> Path | None:
        """Write this step's dumps; returns the file, or None when nothing was chosen."""
        if self.per_step <= 0:
            return None
        groups = self._groups()
        chosen = self._choose(step, groups)
        for held in self._held.values():
            held.fresh = False
        return self._write(self.dir / f"step-{step:06d}.txt", step, chosen, groups)

    def dump_unshown(self, step: int) -> Path | None:
        """At the session's end: the first episode of each mechanism no dump shows yet, from episodes
        that arrived after the last step's dump (a mechanism that first acted in the last step
        would otherwise go unshown by this session). Written beside the last step's file, under
        its step; None when there is none."""
        if self.per_step <= 0:
            return None
        groups = self._groups()
        chosen = [c for c in self._choose(step, groups) if any(w.startswith(FIRST_TO_SHOW) for w in c[1])]
        for _, why, _ in chosen:
            why[:] = [w for w in why if w.startswith(FIRST_TO_SHOW)]
        return self._write(self.dir / f"step-{step:06d}-end.txt", step, chosen, groups)

    def _write(self, path: Path, step: int, chosen: list, groups: dict[str, list[Episode]]) -> Path | None:
        if not chosen:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        blocks = [
            f"# step {step}: {len(chosen)} episodes, chosen as: "
            + "; ".join(f"{h.episode.episode_id} ({', '.join(why)})" for h, why, _ in chosen)
            + "\n"
        ]
        blocks += [self.format(h, why, tags, groups.get(h.episode.group_id)) for h, why, tags in chosen]
        path.write_text("\n".join(blocks), encoding="utf-8")
        rows = (
            {"step": step, "file": path.name, "episode_id": held.episode.episode_id, "why": why, "tags": sorted(tags)}
            for held, why, tags in chosen
        )
        with open(self.dir / INDEX, "a", encoding="utf-8") as index:
            index.writelines(json.dumps(row) + "\n" for row in rows)
        for _, _, tags in chosen:
            self._shown.update(tags)
        return path

    # ------------------------------------------------------------------------------ choosing

    def _choose(self, step: int, groups: dict[str, list[Episode]]) -> list[tuple[_Held, list[str], set[str]]]:
        """(episode, why it was chosen, its tags): the first episode of each mechanism no dump shows
        yet, then the best and the worst new episode, a new retry, and a filtered one."""
        tagged = [(h, self.tags(h, groups.get(h.episode.group_id))) for h in self._held.values()]
        picks: dict[str, tuple[_Held, list[str], set[str]]] = {}

        def pick(held: _Held, tags: set[str], why: str) -> None:
            picks.setdefault(held.episode.episode_id, (held, [], tags))[1].append(why)

        unshown = [m.tag for m in mech.DEMO_MECHANISMS if m.tag not in self._shown]
        for tag in unshown:
            if any(tag in tags for _, _, tags in picks.values()):
                continue
            first = next(((h, t) for h, t in tagged if tag in t), None)
            if first is not None:
                pick(*first, FIRST_TO_SHOW + ", ".join(u for u in unshown if u in first[1]))
        fresh = [(h, t) for h, t in tagged if h.fresh]
        by_reward = sorted(fresh, key=lambda ht: episode_reward(ht[0].episode, self.algo))
        dropped = [(h, t) for h, t in tagged if h.dropped_at == step]
        kinds = [
            ("best", by_reward[-1:]),
            ("worst", by_reward[:1]),
            ("a retry", [(h, t) for h, t in fresh if mech.RETRY in t][:1]),
            ("a filtered one", dropped[:1] or [(h, t) for h, t in fresh if mech.TIED in t][:1]),
        ]
        extra = 0
        for why, found in kinds:
            for held, tags in found:
                if held.episode.episode_id in picks:  # chosen already: say it is this kind too
                    pick(held, tags, why)
                elif extra < self.per_step:
                    extra += 1
                    pick(held, tags, why)
        return list(picks.values())

    def tags(self, held: _Held, group: list[Episode] | None) -> set[str]:
        """The mechanism tags (launch/observe/mechanisms.py) the episode shows, as far as the dumper knows;
        `group`: every episode of its group, when all are held."""
        ep, tags = held.episode, set()
        if ep.is_retry:
            tags.add(mech.RETRY)
            if held.trained is not None:
                tags.add(mech.RETRY_TRAINED)
        elif group is not None and not any(episode_passed(e) for e in group):
            tags.add(mech.ALL_FAILED)
        if (
            group is not None
            and self.algo.drop_tied_groups
            and credit(group, [episode_reward(e, self.algo) for e in group], self.algo).tied
        ):
            tags.add(mech.TIED)
        if held.dropped_at is not None:
            tags.add(mech.MIRRORPOP)
        if held.trained is not None and held.trained[1] >= 1:
            tags.add(mech.OFF_POLICY)
        passed = [turn_passed(t) for t in ep.turns]
        if any(passed[k] and not passed[k - 1] for k in range(1, len(passed))):
            tags.add(mech.REPAIR_PASSED)
        for turn in ep.turns:
            if turn.result is not None and turn.result.error_class in ERROR_CLASSES:
                tags.add(mech.verdict_tag(turn.result.error_class))
        return tags

    def _groups(self) -> dict[str, list[Episode]]:
        """The groups whose every episode is held (G > 1), each in sample order."""
        members: dict[str, list[Episode]] = collections.defaultdict(list)
        for held in self._held.values():
            members[held.episode.group_id].append(held.episode)
        return {
            gid: sorted(eps, key=lambda e: e.sample_index)
            for gid, eps in members.items()
            if len(eps) > 1 and {e.sample_index for e in eps} == set(range(len(eps)))
        }

    # ----------------------------------------------------------------------------- formatting

    def terms(self, ep: Episode, group: list[Episode] | None) -> RewardTerms:
        a = self.algo
        scores = [float(s) for s in ep.rewards]
        passed = [turn_passed(t) for t in ep.turns]
        if not scores:
            return RewardTerms(scores=[], first=0.0, best=0.0, bonus=0.0, reward=0.0)
        first, best = a.alpha * scores[0], (1 - a.alpha) * max(scores)
        bonus = early_bonus(passed, a.early_bonus_turn1, a.early_bonus_turn2)
        if group is None:
            return RewardTerms(scores, first, best, bonus, first + best + bonus)
        rewards = [episode_reward(e, a) for e in group]
        index = [e.episode_id for e in group].index(ep.episode_id)
        advantages = credit(group, rewards, a).advantages[index]
        return RewardTerms(scores, first, best, bonus, first + best + bonus, rewards, advantages)

    def format(self, held: _Held, why: list[str], tags: set[str], group: list[Episode] | None) -> str:
        ep = held.episode
        lines = format_header(ep, why, tags)
        previous = ""
        for index, turn in enumerate(ep.turns):
            prompt = _decode(self.decode_prompt or self.decode, turn.prompt_ids)
            lines += format_turn(index, turn, self.decode, prompt, previous)
            previous = prompt
        lines += format_terms(self.terms(ep, group), self.algo) + format_fate(held, tags)
        return "\n".join(lines) + "\n"


def read_index(run_dir: Path) -> list[dict]:
    """The rows of `run_dir/episodes/index.jsonl` (a torn or foreign line is skipped)."""
    path = Path(run_dir) / "episodes" / INDEX
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("tags"), list) and isinstance(row.get("file"), str):
            rows.append(row)
    return rows


def format_header(ep: Episode, why: list[str], tags: set[str]) -> list[str]:
    task = ep.task
    name = task.kernel.name if task.kernel is not None else task.kind
    lines = [
        "=" * 100,
        f"episode {ep.episode_id}  task {task.task_id} ({name})  group {ep.group_id} "
        f"sample {ep.sample_index}  actor {ep.actor_id or '?'}" + ("  [BDR retry]" if ep.is_retry else ""),
        f"chosen as: {', '.join(why)}" + (f"  |  shows: {', '.join(sorted(tags))}" if tags else ""),
    ]
    if task.repair is not None:
        lines.append(
            f"retry of group {task.repair.origin_group} (served {task.repair.attempt} time(s) from the "
            "retry buffer); its first prompt carries that group's best failed answer and this feedback:"
        )
        lines.append(_indent(_cut(task.repair.feedback, FEEDBACK_CHARS)))
    return lines


def format_turn(index: int, turn: Turn, decode: Decode, prompt: str, previous: str) -> list[str]:
    versions = f"v{int(turn.versions.min())}-v{int(turn.versions.max())}" if len(turn.versions) else "no tokens"
    shared = _shared_prefix(previous, prompt)
    if shared > len(prompt) // 4:  # the dialogue continues: show what this prompt adds
        shown = [
            f"prompt (its first {shared} characters repeat turn {index - 1}'s prompt; then):",
            _indent(_cut(prompt[shared:], RESPONSE_CHARS)),
        ]
    else:
        shown = ["prompt (as the chat template rendered it):", _indent(_cut(prompt, PROMPT_CHARS))]
    lines = [
        "-" * 100,
        (
            f"turn {index} ({turn.kind}): {len(turn.prompt_ids)} prompt tokens, {len(turn.response_ids)} response "
            f"tokens ({versions}, finish: {turn.finish_reason})"
        ),
        *shown,
    ]
    if turn.reasoning:
        lines += ["thinking:", _indent(_cut(turn.reasoning, RESPONSE_CHARS))]
    lines += ["response:", _indent(_cut(turn.text or _decode(decode, turn.response_ids), RESPONSE_CHARS))]
    return lines + format_verdict(turn.result)


def format_verdict(result: VerifyResult | None) -> list[str]:
    if result is None:
        return ["verdict: none (not verified)"]
    speed = ", ".join(
        f"{name} {value:.2f}x"
        for name, value in (("vs eager", result.speedup_eager), ("vs compile", result.speedup_compile))
        if value is not None
    )
    lines = [
        f"verdict: {'PASSED' if result.passed else 'failed'} at stage {result.stage}"
        + (f", error {result.error_class}" if result.error_class else "")
        + f", q {result.q:.2f}, score s {result.score:+.3f}"
        + (f", speedup {speed}" if speed else "")
        + (" (cached)" if result.cached else ""),
    ]
    if result.diagnostics.get("review"):
        lines.append("!! speedup above verifier.legality.review_speedup: FLAGGED FOR HUMAN REVIEW")
    flags = {k: result.diagnostics[k] for k in DIAGNOSTIC_KEYS if result.diagnostics.get(k)}
    if flags:
        lines.append(f"diagnostics: {_cut(repr(flags), FEEDBACK_CHARS)}")
    if result.feedback:
        lines += ["feedback:", _indent(_cut(result.feedback, FEEDBACK_CHARS))]
    return lines


def format_terms(t: RewardTerms, algo: AlgoConfig) -> list[str]:
    lines = [
        "-" * 100,
        "reward: s per turn " + (", ".join(f"{s:+.3f}" for s in t.scores) or "none"),
        (
            f"PrimeEcho R = α·s_first + (1-α)·max s + b_early = {t.first:+.3f} + {t.best:+.3f} + {t.bonus:+.3f} "
            f"= {t.reward:+.3f}  (α = {algo.alpha:g})"
        ),
    ]
    if t.advantages is not None:
        shown = t.advantages if algo.turn_credit == "per_turn" else t.advantages[:1]  # episode credit: one for all
        lines.append(
            ("advantage per turn " if len(shown) > 1 else "advantage ")
            + ", ".join(f"{x:+.3f}" for x in shown)
            + f" in its group of {len(t.group_rewards)} (R: "
            + ", ".join(f"{r:+.3f}" for r in t.group_rewards)
            + ")"
        )
    else:
        lines.append("advantage: not shown (the dumper does not hold the whole group)")
    return lines


def format_fate(held: _Held, tags: set[str]) -> list[str]:
    fate = []
    if held.trained is not None:
        fate.append(f"trained at step {held.trained[0]} (lag {held.trained[1]})")
    if held.dropped_at is not None:
        fate.append(f"dropped by MirrorPop at step {held.dropped_at} (its mean |log π_prox - log μ| exceeded δ)")
    if mech.TIED in tags:
        fate.append("its group's rewards all tie: filtered as 'tied' (dynamic sampling)")
    if mech.ALL_FAILED in tags:
        fate.append("every sample of its group failed: the task entered the retry buffer")
    return [
        "what happened to it: "
        + ("; ".join(fate) if fate else "not known to the driver yet (pending, or trained after this dump)")
    ]


def _shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix, backed off to the start of the line where the two part (or of
    the line before, when they part at a line start), so the role marker of the new part shows."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return b.rfind("\n", 0, max(n - 1, 0)) + 1 if n < len(b) else n


def _decode(decode, ids) -> str:
    try:
        return decode([int(i) for i in ids])
    except Exception as err:  # noqa: BLE001 - a tokenizer that cannot decode must not lose the rest of the dump
        return f"<could not decode {len(ids)} tokens: {err!r}>"


def _cut(text: str, limit: int) -> str:
    """Keep the head and the tail; the middle of a long text says least."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    <empty>"
