"""Supervised chat examples: the one data format of `kiln sft`, written by `kiln rft` and built by the
learner's warm start.

A data file is JSONL, one example per line:

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "reasoning": "...", "train": false},
                  {"role": "user", "content": "The verifier rejected this answer. ..."},
                  {"role": "assistant", "content": "```python\\n...\\n```"}],
     "task_id": "level1/01_relu", "meta": {...}}

* `messages`: a chat conversation: an optional system message first, then user and assistant
  messages, ending with an assistant message (the answer trained on). Single-turn examples have one
  assistant message; multi-turn ones (repair dialogues) several.
* `reasoning` (assistant, optional): thinking text, rendered in the chat template's think block.
* `train` (assistant, optional, default true): false makes the message context only, without loss.
  A repair dialogue marks its failed answers so: the model learns to repair, never the failure.
* `task_id` (optional): the task the example answers; decontamination drops examples of evaluation
  tasks by it. `meta` (optional): anything (kiln rft records verdicts and speedups there).

`read_examples` validates a file and raises `DataError` with "FILE:LINE: problem" for the first bad
line, so a CLI answers with one line. This module reads and writes text only; turning an example
into token ids and a loss mask is `actors.policy.chat_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.policy.tokenizer import Message

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = frozenset({"role", "content", "reasoning", "train"})
EXAMPLE_KEYS = frozenset({"messages", "task_id", "meta"})


class DataError(ValueError):
    """A data file or line that is not a valid example; the message is one line naming where."""


@dataclass(frozen=True)
class ChatExample:
    """One conversation and which of its assistant messages carry loss."""

    messages: tuple[Message, ...]
    untrained: frozenset[int] = frozenset()  # indices of assistant messages that are context only
    task_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def trained(self, index: int) -> bool:
        return self.messages[index].role == "assistant" and index not in self.untrained

    def to_json(self) -> dict[str, Any]:
        messages = []
        for i, m in enumerate(self.messages):
            row: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.reasoning:
                row["reasoning"] = m.reasoning
            if m.role == "assistant" and i in self.untrained:
                row["train"] = False
            messages.append(row)
        out: dict[str, Any] = {"messages": messages}
        if self.task_id is not None:
            out["task_id"] = self.task_id
        if self.meta:
            out["meta"] = self.meta
        return out


def parse_example(obj: Any) -> ChatExample:
    """An example from one decoded JSON line; ValueError naming the first problem."""
    if not isinstance(obj, dict):
        raise ValueError(f"an example is a JSON object, got {type(obj).__name__}")  # noqa: TRY004 - the contract: ValueError
    unknown = sorted(set(obj) - EXAMPLE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (an example has messages, task_id, meta)")
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list")
    messages, untrained = [], set()
    for i, m in enumerate(raw):
        message, trained = _parse_message(m, i)
        if message.role == "system" and i > 0:
            raise ValueError(f"message {i}: a system message may only come first")
        if not trained:
            untrained.add(i)
        messages.append(message)
    if messages[-1].role != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    if not any(m.role == "user" for m in messages):
        raise ValueError("no user message: an answer needs a question")
    if len(untrained) == sum(m.role == "assistant" for m in messages):
        raise ValueError("every assistant message has train=false: nothing to learn")
    task_id = obj.get("task_id")
    if task_id is not None and not isinstance(task_id, str):
        raise ValueError("'task_id' must be a string")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("'meta' must be an object")  # noqa: TRY004 - the contract: ValueError
    return ChatExample(messages=tuple(messages), untrained=frozenset(untrained), task_id=task_id, meta=meta)


def _parse_message(m: Any, i: int) -> tuple[Message, bool]:
    if not isinstance(m, dict):
        raise ValueError(f"message {i} is a {type(m).__name__}, not an object")  # noqa: TRY004 - the contract: ValueError
    unknown = sorted(set(m) - MESSAGE_KEYS)
    if unknown:
        raise ValueError(f"message {i}: unknown key {unknown[0]!r} (a message has role, content, reasoning, train)")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(content, str):
        raise ValueError(f"message {i}: 'content' must be a string")  # noqa: TRY004 - the contract: ValueError
    reasoning = m.get("reasoning", "")
    if not isinstance(reasoning, str) or (reasoning and role != "assistant"):
        raise ValueError(f"message {i}: 'reasoning' is a string, on assistant messages only")
    trained = m.get("train", True)
    if not isinstance(trained, bool) or (not trained and role != "assistant"):
        raise ValueError(f"message {i}: 'train' is true or false, on assistant messages only")
    if role == "assistant" and not content.strip() and trained:
        raise ValueError(f"message {i}: an assistant answer trained on is empty")
    return Message(role, content, reasoning), trained


def data_files(path: str | Path) -> list[Path]:
    """The JSONL files `path` names: the file itself, or every *.jsonl under a directory, sorted."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{root}: no such file or directory")
    files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if not files:
        raise DataError(f"{root}: no *.jsonl file in this directory")
    return files


def read_examples(path: str | Path) -> Iterator[ChatExample]:
    """Every example of a file or directory, in order; DataError "FILE:LINE: problem" on the first bad
    line. Blank lines are skipped."""
    for file in data_files(path):
        try:
            # opened apart so only open()'s OSError reads 'cannot be read'; the with below closes it
            handle = open(file, encoding="utf-8")  # noqa: SIM115
        except OSError as err:
            raise DataError(f"{file}: cannot be read: {err.strerror}") from None
        with handle:
            lineno = 0
            try:
                for lineno, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{file}:{lineno}: not JSON: {err.msg} (column {err.colno})") from None
                    try:
                        yield parse_example(obj)
                    except ValueError as err:
                        raise DataError(f"{file}:{lineno}: {err}") from None
            except UnicodeDecodeError as err:
                raise DataError(f"{file}:{lineno + 1}: not UTF-8 text (byte {err.start} of the read block)") from None


def write_examples(path: str | Path, examples: list[ChatExample]) -> Path:
    """Write examples as JSONL (replacing the file atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(example.to_json(), ensure_ascii=False) + "\n" for example in examples)
    tmp.replace(path)
    return path


def first_code_block(text: str) -> str | None:
    """The body of the first ```python (or bare ```) fenced block of `text`, None when there is none."""
    start = text.find("```")
    if start < 0:
        return None
    body = text.find("\n", start)
    end = text.find("```", body + 1) if body >= 0 else -1
    return text[body + 1 : end] if body >= 0 and end >= 0 else None


def reference_of(example: ChatExample) -> str | None:
    """The reference program the example's task poses: the first fenced block of its first user
    message (how `actors.policy.prompts.opening` shows it), None when it shows none."""
    for m in example.messages:
        if m.role == "user":
            return first_code_block(m.content)
    return None
