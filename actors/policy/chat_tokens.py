"""A chat example as token sequences with a loss mask: what `kiln sft`, the learner's warm start and
RL all train on, laid out alike.

Each assistant message that carries loss becomes one sequence: its prompt is the conversation before
it rendered by the tokenizer (the chat template, with the generation prompt, exactly as the rollout's
turn policy renders the prompt of that turn), and its response is the answer's tokens followed by the
token that ends an assistant turn: what the engine generates at that turn, and how an RL turn is
packed (one sequence per turn). Only the response carries loss. A multi-turn example (a repair
dialogue) therefore puts its earlier answers and the feedback on them in the prompt of its later
answers, as context, and an answer marked `train: false` appears only as context.

Why not one sequence per conversation with the template's rendering of the whole dialogue: chat
templates render a past answer differently from the prompt the model answered (Qwen-style templates
write an empty think block into the generation prompt, and not into history), so a single rendering
would train the model on a layout it never sees when it answers.

Thinking: with `enable_thinking` the response is the think block (the message's reasoning) followed by
the answer, as a thinking model writes it after the generation prompt; without it the generation
prompt already closes an empty think block and the reasoning is not trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.policy.chat_data import ChatExample
from actors.policy.tokenizer import THINK_CLOSE, THINK_OPEN


@dataclass(frozen=True)
class TokenSequence:
    """One trained answer: prompt ids (no loss) and response ids (loss)."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def ids(self) -> list[int]:
        return [*self.prompt, *self.response]

    @property
    def loss_mask(self) -> list[bool]:
        return [False] * len(self.prompt) + [True] * len(self.response)


def response_ids(tokenizer, content: str, reasoning: str = "", *, enable_thinking: bool = False) -> list[int]:
    """An answer's tokens as the engine would generate them: the think block first when thinking is
    on and there is reasoning, then the answer, then the end-of-turn token."""
    text = content
    if enable_thinking and reasoning:
        text = f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{content}"
    end = tokenizer.end_of_turn_id
    return tokenizer.encode(text) + ([int(end)] if end is not None else [])


def tokenize_example(example: ChatExample, tokenizer, *, enable_thinking: bool = False) -> list[TokenSequence]:
    """One sequence per assistant message that carries loss (module docstring)."""
    out = []
    for i, message in enumerate(example.messages):
        if not example.trained(i):
            continue
        prompt = tokenizer.render(list(example.messages[:i]), enable_thinking=enable_thinking)
        response = response_ids(tokenizer, message.content, message.reasoning, enable_thinking=enable_thinking)
        out.append(TokenSequence(prompt=tuple(prompt), response=tuple(response)))
    return out


def fit(sequence: TokenSequence, max_seq_len: int) -> TokenSequence | None:
    """The sequence cut to `max_seq_len` at the end of its response (it still trains on the answer's
    start); None when the prompt alone leaves no room for a response token."""
    if len(sequence) <= max_seq_len:
        return sequence
    keep = max_seq_len - len(sequence.prompt)
    if keep < 1:
        return None
    return TokenSequence(prompt=sequence.prompt, response=sequence.response[:keep])
