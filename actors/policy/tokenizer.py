"""Tokenizers for rollout prompts and the learner's warm start: a built-in byte-level one for tiny
models and the fastest unit tests, and an HF tokenizer from a checkpoint directory for real models.

Both speak in conversations (`Message`s) rather than strings:

* `render(messages, enable_thinking=...)` -> the prompt's token ids, ending where the assistant's
  answer begins. An HF tokenizer with a chat template renders through it (to text, then encoded
  without added special tokens: the template places them; text is the one return type every
  transformers version in the supported range agrees on). A tokenizer without a template (the byte
  tokenizer included) uses the plain format below.
* `split_response(ids)` -> `Response(answer, reasoning)`: a thinking model's `<think>...</think>`
  block is the reasoning, the text after it the answer. The verifier only ever sees the answer.
* `stop_ids`: where a response ends. For an HF checkpoint the union of `generation_config.json`'s
  eos ids, the tokenizer's eos and the chat template's end-of-turn token (`<|im_end|>` for Qwen),
  which many checkpoints name only in their template.

The plain format (no chat template): the system message and a blank line, the first user message
as it is, then each answer followed by a newline and each later user message as
`Feedback: <text>` and a newline; the next answer follows the text directly. A single-turn
conversation without a system message is therefore exactly its user text, which is how small
completion models (the byte-level test models) are prompted. An answer's reasoning, when a history
keeps it, is written `<think>\\n...\\n</think>\\n\\n` before the answer.

No hub downloads unless `model.allow_download` says so: the machines may have no internet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from configs import ModelConfig

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SENTINEL = "KILN-END-OF-TURN-PROBE"


@dataclass(frozen=True)
class Message:
    """One message of a chat conversation."""

    role: Literal["system", "user", "assistant"]
    content: str
    reasoning: str = ""  # an assistant message's thinking text ("" = none, or left out)

    def as_template_dict(self) -> dict[str, str]:
        """The message as chat templates read it. Reasoning goes under both names in use: `reasoning`
        (Kiln's tiny template) and `reasoning_content` (Qwen3's)."""
        out = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        return out


@dataclass(frozen=True)
class Response:
    """A decoded response: the answer (what is verified and shown in later turns) and its thinking."""

    answer: str
    reasoning: str = ""


def plain_text(messages: Sequence[Message]) -> str:
    """A conversation in the plain format (module docstring)."""
    parts: list[str] = []
    seen_user = False
    for m in messages:
        if m.role == "system":
            parts.append(m.content.rstrip("\n") + "\n\n")
        elif m.role == "assistant":
            think = f"{THINK_OPEN}\n{m.reasoning.strip()}\n{THINK_CLOSE}\n\n" if m.reasoning else ""
            parts.append(think + m.content.strip("\n") + "\n")
        elif not seen_user:
            seen_user = True
            parts.append(m.content if m.content.endswith("\n") else m.content + "\n")
        else:
            parts.append(f"Feedback: {m.content.strip()}\n")
    return "".join(parts)


def split_thinking(text: str) -> Response:
    """Split decoded text at the end of its think block. Text that opens a think block and never
    closes it (cut off while thinking) is all reasoning: there is no answer to verify."""
    head, sep, tail = text.partition(THINK_CLOSE)
    if sep:
        return Response(answer=tail.strip("\n"), reasoning=_strip_open(head))
    if text.lstrip().startswith(THINK_OPEN):
        return Response(answer="", reasoning=_strip_open(text))
    return Response(answer=text)


def _strip_open(text: str) -> str:
    text = text.strip()
    return text[len(THINK_OPEN) :].strip() if text.startswith(THINK_OPEN) else text


class ByteTokenizer:
    """Token i < 256 is byte i; then BOS, EOS, PAD. 259 ids, matching `model.vocab_size`'s default.
    It has no chat template: conversations render in the plain format after a BOS."""

    vocab_size = 259
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def decode_prompt(self, ids) -> str:
        return self.decode(ids)

    def render(self, messages: Sequence[Message], *, enable_thinking: bool = False) -> list[int]:
        return [self.bos_token_id, *self.encode(plain_text(messages))]

    def render_text(self, messages: Sequence[Message], *, enable_thinking: bool = False) -> str:
        return plain_text(messages)

    def split_response(self, ids) -> Response:
        return split_thinking(self.decode(ids))

    @property
    def stop_ids(self) -> list[int]:
        return [self.eos_token_id]

    @property
    def end_of_turn_id(self) -> int:
        return self.eos_token_id


class HFTokenizer:
    """A tokenizer from an HF checkpoint (or tokenizer) directory, with its chat template when it has
    one; `checkpoint` is the model directory whose generation_config.json names eos ids."""

    def __init__(self, path: str, *, checkpoint: str | None = None, allow_download: bool = False) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=not allow_download)
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(self.tok.chat_template)
        self._generation_eos = _generation_eos_ids(checkpoint or path)
        self._think = (self._single_id(THINK_OPEN), self._single_id(THINK_CLOSE))
        self._end_of_turn = self._template_end_of_turn() if self.has_chat_template else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_prompt(self, ids) -> str:
        """A prompt as text with its chat markup (role markers and all), for people to read."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def render_text(self, messages: Sequence[Message], *, enable_thinking: bool = False) -> str:
        """The prompt as text, ending where the assistant's answer begins."""
        if not self.has_chat_template:
            return plain_text(messages)
        text = self.tok.apply_chat_template(
            [m.as_template_dict() for m in messages],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        if not isinstance(text, str):
            raise TypeError(f"{self.path}: the chat template rendered a {type(text).__name__}, not text")
        return text

    def render(self, messages: Sequence[Message], *, enable_thinking: bool = False) -> list[int]:
        text = self.render_text(messages, enable_thinking=enable_thinking)
        if self.has_chat_template:  # the template wrote every special token it wants
            return self.encode(text)
        return self.tok.encode(text)  # plain format: the tokenizer's own BOS, if it has one

    def split_response(self, ids) -> Response:
        """Split at the think-closing token when the vocabulary has it as one token (it may be a
        special token that decoding drops), else on the decoded text."""
        ids = [int(i) for i in ids]
        open_id, close_id = self._think
        if close_id is not None and close_id in ids:
            cut = ids.index(close_id)
            head = ids[1:cut] if open_id is not None and ids[:1] == [open_id] else ids[:cut]
            return Response(answer=self.decode(ids[cut + 1 :]).strip("\n"), reasoning=_strip_open(self.decode(head)))
        if open_id is not None and ids[:1] == [open_id]:
            return Response(answer="", reasoning=self.decode(ids[1:]).strip())
        return split_thinking(self.decode(ids))

    @property
    def stop_ids(self) -> list[int]:
        """generation_config.json's eos ids, the tokenizer's eos and the template's end of turn."""
        ids = list(self._generation_eos)
        for extra in (self.eos_token_id, self._end_of_turn):
            if extra is not None and int(extra) not in ids:
                ids.append(int(extra))
        return ids

    @property
    def end_of_turn_id(self) -> int | None:
        """The token that closes an assistant turn: the template's end of turn, else eos."""
        return self._end_of_turn if self._end_of_turn is not None else self.eos_token_id

    def _single_id(self, token: str) -> int | None:
        ids = self.tok.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _template_end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message's content."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            text = self.tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that refuses this conversation: no end-of-turn token
            return None
        if not isinstance(text, str) or _SENTINEL not in text:
            return None
        after = self.encode(text.split(_SENTINEL, 1)[1])
        special = set(self.tok.all_special_ids) | set(self.tok.added_tokens_decoder)
        return after[0] if after and after[0] in special else None


def _generation_eos_ids(directory: str) -> list[int]:
    """The eos ids of `directory/generation_config.json` (an int or a list there); [] when absent."""
    path = Path(directory) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []


def load_tokenizer(cfg: ModelConfig) -> ByteTokenizer | HFTokenizer:
    if cfg.path:
        from actors.policy.model import unresolved

        unresolved(cfg.path)
        return HFTokenizer(cfg.path, allow_download=cfg.allow_download)
    if cfg.tokenizer == "bytes":
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"the byte tokenizer needs model.vocab_size >= 259, got {cfg.vocab_size}")
        return ByteTokenizer()
    return HFTokenizer(cfg.tokenizer, allow_download=cfg.allow_download)
