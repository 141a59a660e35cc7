"""Readable episode dumps: `run_dir/episodes/step-000012.txt`, a few episodes per learner step as
plain text, so a person can read what the policy wrote and what the verifier said about it.

Reward hacking shows up as high rewards for code that should not earn them, so the dump picks the
highest-reward episodes of the step first. Prompts are decoded with their chat markup (role markers
and all), so a repair turn reads as the dialogue the policy saw. The first prompt is long and
repetitive (the rules, the reference code); it is cut in the middle. A later turn's prompt repeats
the earlier one, so only what it adds is shown (the earlier answer as an assistant turn and the
feedback as a user turn). Responses and their thinking are kept whole up to a generous limit, since
a hack is in them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from protocols import Episode, Turn, VerifyResult

PROMPT_CHARS = 1500
RESPONSE_CHARS = 12000
FEEDBACK_CHARS = 2000
# Verifier diagnostics worth a reader's eye: legality violations, vendor libraries, errors.
DIAGNOSTIC_KEYS = ("violations", "vendor_libs", "error", "max_abs_error")


def dump_episodes(run_dir: Path, step: int, episodes: list[Episode], decode: Callable[[list[int]], str],
                  limit: int, decode_prompt: Callable[[list[int]], str] | None = None) -> Path | None:
    """Write up to `limit` episodes of `step`; returns the file, or None when there was nothing to
    write (limit 0 or no episodes). `decode_prompt` decodes prompts with their chat markup (default:
    `decode`)."""
    chosen = sorted(episodes, key=lambda e: -max(e.rewards, default=float("-inf")))[:max(limit, 0)]
    if not chosen:
        return None
    directory = Path(run_dir) / "episodes"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:06d}.txt"
    blocks = [f"# step {step}: {len(chosen)} of {len(episodes)} episodes, highest reward first\n"]
    blocks += [format_episode(e, decode, decode_prompt) for e in chosen]
    path.write_text("\n".join(blocks), encoding="utf-8")
    return path


def format_episode(episode: Episode, decode: Callable[[list[int]], str],
                   decode_prompt: Callable[[list[int]], str] | None = None) -> str:
    task = episode.task
    name = task.kernel.name if task.kernel is not None else task.kind
    lines = [
        "=" * 100,
        f"episode {episode.episode_id}  task {task.task_id} ({name})  group {episode.group_id} "
        f"sample {episode.sample_index}  actor {episode.actor_id or '?'}" + ("  [BDR retry]" if episode.is_retry else ""),
        "rewards per turn: " + ", ".join(f"{r:+.3f}" for r in episode.rewards),
    ]
    if task.repair is not None:
        lines.append(f"retry of group {task.repair.origin_group} (attempt {task.repair.attempt}); its feedback:")
        lines.append(_indent(_cut(task.repair.feedback, FEEDBACK_CHARS)))
    previous = ""
    for index, turn in enumerate(episode.turns):
        prompt = _decode(decode_prompt or decode, turn.prompt_ids)
        lines += _format_turn(index, turn, decode, prompt, previous)
        previous = prompt
    return "\n".join(lines) + "\n"


def _format_turn(index: int, turn: Turn, decode, prompt: str, previous: str) -> list[str]:
    versions = f"v{int(turn.versions.min())}-v{int(turn.versions.max())}" if len(turn.versions) else "no tokens"
    shared = _shared_prefix(previous, prompt)
    if shared > len(prompt) // 4:  # the dialogue continues: show what this prompt adds
        shown = [f"prompt (its first {shared} characters repeat turn {index - 1}'s prompt; then):",
                 _indent(_cut(prompt[shared:], RESPONSE_CHARS))]
    else:
        shown = ["prompt:", _indent(_cut(prompt, PROMPT_CHARS))]
    lines = [
        "-" * 100,
        f"turn {index} ({turn.kind}): {len(turn.prompt_ids)} prompt tokens, {len(turn.response_ids)} response "
        f"tokens ({versions}, finish: {turn.finish_reason})",
        *shown,
    ]
    if turn.reasoning:
        lines += ["thinking:", _indent(_cut(turn.reasoning, RESPONSE_CHARS))]
    lines += ["response:", _indent(_cut(turn.text or _decode(decode, turn.response_ids), RESPONSE_CHARS))]
    return lines + _format_verdict(turn.result)


def _shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix, backed off to the start of the line where the two part (or of
    the line before, when they part at a line start), so the role marker of the new part shows."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return b.rfind("\n", 0, max(n - 1, 0)) + 1 if n < len(b) else n


def _format_verdict(result: VerifyResult | None) -> list[str]:
    if result is None:
        return ["verdict: none (not verified)"]
    speed = ", ".join(f"{name} {value:.2f}x" for name, value in
                      (("vs eager", result.speedup_eager), ("vs compile", result.speedup_compile)) if value is not None)
    lines = [
        f"verdict: {'PASSED' if result.passed else 'failed'} at stage {result.stage}"
        + (f", error {result.error_class}" if result.error_class else "")
        + f", q {result.q:.2f}, score {result.score:+.3f}" + (f", speedup {speed}" if speed else "")
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


def _decode(decode, ids) -> str:
    try:
        return decode([int(i) for i in ids])
    except Exception as err:  # a tokenizer that cannot decode must not lose the rest of the dump
        return f"<could not decode {len(ids)} tokens: {err!r}>"


def _cut(text: str, limit: int) -> str:
    """Keep the head and the tail; the middle of a long text says least."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    <empty>"
