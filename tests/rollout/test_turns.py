"""The turn policy (actors/rollout/turns.py) and the prompts it assembles: chat conversations rendered
by the tokenizer's template, repair turns that continue the dialogue, history and elision, tasks that
cannot fit, performance turns, thinking text kept out of what is verified, and the stop ids."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from actors.policy.tokenizer import ByteTokenizer, HFTokenizer, Message, Response, plain_text
from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
from actors.rollout.episodes import Pipeline
from actors.rollout.turns import Attempt, Done, Prompt, TurnPolicy, TurnRules
from configs.loader import load_config
from protocols import RepairContext, TaskReply, VerifyRequest, VerifyResult, decode, encode
from tasks.loader import load_tasks

TASKS = {t.task_id: t for t in load_tasks("tasks", "cpu")}
RELU = TASKS["level1/01_relu"]
ANSWER = "```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n```"


@pytest.fixture(scope="module")
def chat(tiny_chat_model):
    return HFTokenizer(str(tiny_chat_model))


def verdict(passed=False, feedback="error: expected ';' before '}'", speedup=None, error="compile"):
    return VerifyResult(
        request_id="r",
        task_id=RELU.task_id,
        passed=passed,
        stage="done" if passed else "compile",
        error_class=None if passed else error,
        q=1.0 if passed else 0.0,
        score=1.0 if passed else -1.0,
        speedup_eager=speedup,
        feedback=feedback,
    )


def answer_turn(policy, prompt, text, result, reasoning=""):
    """One turn of the loop that calls the policy: answer `prompt` with `text`, get `result`."""
    return policy.next_prompt(prompt.attempt.answered(prompt.kind, Response(text, reasoning)), result)


def test_prompts_are_chat_conversations_rendered_by_the_template(chat):
    policy = TurnPolicy(TurnRules(max_turns=3, max_seq_len=4096, max_new_tokens=256), chat)
    first = policy.next_prompt(Attempt.of(RELU), None)
    assert isinstance(first, Prompt) and first.kind == "first" and first.left_out == 0
    assert [m.role for m in first.messages] == ["system", "user"]
    assert "ModelNew" in first.messages[0].content and RELU.kernel.reference.strip() in first.messages[1].content
    # token ids, not the keys of a BatchEncoding (transformers 5's apply_chat_template(tokenize=True))
    assert all(isinstance(i, int) for i in first.ids)
    text = chat.decode_prompt(first.ids)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off by default
    thinking = TurnPolicy(dataclasses.replace(policy.rules, enable_thinking=True), chat)
    assert chat.decode_prompt(thinking.next_prompt(Attempt.of(RELU), None).ids).endswith("<|im_start|>assistant\n")


def test_a_repair_turn_continues_the_dialogue_with_every_earlier_answer(chat):
    policy = TurnPolicy(TurnRules(max_turns=3, max_seq_len=4096, max_new_tokens=256), chat)
    first = policy.next_prompt(Attempt.of(RELU), None)
    second = answer_turn(policy, first, ANSWER + "\n# one", verdict(feedback="FEEDBACK-1"))
    third = answer_turn(policy, second, ANSWER + "\n# two", verdict(feedback="FEEDBACK-2"))
    assert second.kind == third.kind == "repair"
    assert [m.role for m in third.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    text = chat.decode_prompt(third.ids)
    # turn 3 still sees turn 1: both answers as the model's own turns, each followed by its feedback
    one, two = text.index("# one"), text.index("# two")
    assert text.index("FEEDBACK-1") > one and text.index("FEEDBACK-2") > two > one
    turns = text.split("<|im_start|>assistant\n")[1:3]
    for turn in turns:  # the answer as it was written: one fence, never a fence inside a fence
        body = turn.split("<|im_end|>")[0]
        assert body.startswith("```python\n") and body.count("```") == 2
    # the first prompt is a prefix of the repair prompt's text: the dialogue only grows
    assert text.startswith(chat.decode_prompt(first.ids).removesuffix("<think>\n\n</think>\n\n"))
    assert answer_turn(policy, third, ANSWER, verdict()) == Done("failed")  # max_turns = 3


def test_history_last_shows_the_task_and_the_newest_exchange_and_says_so(chat):
    policy = TurnPolicy(TurnRules(max_turns=3, max_seq_len=4096, max_new_tokens=256, history="last"), chat)
    second = answer_turn(policy, policy.next_prompt(Attempt.of(RELU), None), ANSWER + "\n# one", verdict())
    third = answer_turn(policy, second, ANSWER + "\n# two", verdict())
    assert second.left_out == 0 and third.left_out == 1
    text = chat.decode_prompt(third.ids)
    assert "# one" not in text and "# two" in text and "1 earlier turn at this task" in text


def test_old_turns_are_elided_to_fit_and_the_attempt_goes_on():
    tok = ByteTokenizer()
    base = TurnPolicy(TurnRules(max_turns=4, max_seq_len=100_000, max_new_tokens=64), tok)
    long_answer = "```python\n" + "x = 1\n" * 60 + "```"
    p = base.next_prompt(Attempt.of(RELU), None)
    sizes = [len(p.ids)]
    for _ in range(2):
        p = answer_turn(base, p, long_answer, verdict())
        sizes.append(len(p.ids))
    exchange = sizes[2] - sizes[1]
    # room for the task and one exchange (and the note), never for two
    room = sizes[1] + 64 + exchange // 2
    tight = TurnPolicy(dataclasses.replace(base.rules, max_seq_len=room), tok)
    q = tight.next_prompt(Attempt.of(RELU), None)
    left_out = []
    for _ in range(3):
        q = answer_turn(tight, q, long_answer, verdict())
        assert isinstance(q, Prompt), q  # never infra, never an error: older turns go instead
        assert len(q.ids) + 64 <= room and q.kind == "repair"
        left_out.append(q.left_out)
    assert left_out == [0, 1, 2] and "2 earlier turns at this task" in tok.decode(q.ids)
    assert tok.decode(q.ids).endswith("Fix it and answer with the complete corrected file.\n")
    # when even the newest exchange does not fit beside the task, the attempt ends (not as infra)
    cramped = TurnPolicy(dataclasses.replace(base.rules, max_seq_len=sizes[0] + 64 + 20), tok)
    first = cramped.next_prompt(Attempt.of(RELU), None)
    done = answer_turn(cramped, first, long_answer, verdict())
    assert isinstance(done, Done) and done.reason == "context" and "max_seq_len" in done.detail


def test_a_task_that_cannot_fit_alone_is_unservable_with_its_size():
    tok = ByteTokenizer()
    size = len(
        TurnPolicy(TurnRules(max_turns=1, max_seq_len=10**6, max_new_tokens=1), tok)
        .next_prompt(Attempt.of(RELU), None)
        .ids
    )
    policy = TurnPolicy(TurnRules(max_turns=3, max_seq_len=size + 100, max_new_tokens=101), tok)
    done = policy.next_prompt(Attempt.of(RELU), None)
    assert done == Done(
        "unservable",
        f"its first prompt is {size} tokens; with rollout.max_new_tokens = 101 "
        f"that exceeds model.max_seq_len = {size + 100}",
    )
    assert isinstance(
        TurnPolicy(dataclasses.replace(policy.rules, max_new_tokens=100), tok).next_prompt(Attempt.of(RELU), None),
        Prompt,
    )


def test_a_passing_but_slow_kernel_gets_a_performance_turn(chat):
    rules = TurnRules(max_turns=3, max_seq_len=4096, max_new_tokens=256, optimize_turns=1, optimize_until=1.1)
    policy = TurnPolicy(rules, chat)
    first = policy.next_prompt(Attempt.of(RELU), None)
    slow = verdict(passed=True, speedup=0.62, feedback="Time per call: your kernel 1.6 ms, eager PyTorch 1.0 ms.")
    optimize = answer_turn(policy, first, ANSWER, slow)
    assert isinstance(optimize, Prompt) and optimize.kind == "optimize"
    text = optimize.messages[-1].content
    assert "0.62x" in text and "faster" in text and optimize.messages[-2].content == ANSWER
    assert "your kernel 1.6 ms, eager PyTorch 1.0 ms" in text  # the verifier's times, as it gave them
    assert "speedup of at least 1.10x" in text  # and the threshold it has to beat
    # the budget of performance turns is spent: the next pass ends the attempt, slow or not
    assert answer_turn(policy, optimize, ANSWER, slow) == Done("passed")
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=1.3)) == Done("passed")
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=None)) == Done("passed")
    # a speedup at the threshold is not below it; optimize_until = 2: a speedup of 1.3 is slow
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=1.1)) == Done("passed")
    double = TurnPolicy(dataclasses.replace(rules, optimize_until=2.0), chat)
    assert answer_turn(double, first, ANSWER, verdict(passed=True, speedup=1.3)).kind == "optimize"
    off = TurnPolicy(dataclasses.replace(rules, optimize_turns=0), chat)
    assert answer_turn(off, first, ANSWER, slow) == Done("passed")
    # infra ends an attempt at once; a failed performance turn gets a repair turn like any other
    assert answer_turn(policy, first, ANSWER, verdict(error="infra")).reason == "infra"
    assert answer_turn(policy, optimize, ANSWER, verdict()).kind == "repair"


def test_the_default_config_takes_a_performance_turn_until_the_evaluations_fast_threshold(chat):
    cfg = load_config(None)
    rules = TurnRules.from_config(cfg.rollout, cfg.model, cfg.eval)
    assert rules.optimize_turns == 1 and rules.optimize_until == cfg.eval.fast_threshold == 1.1
    policy = TurnPolicy(rules, chat)
    first = policy.next_prompt(Attempt.of(RELU), None)
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=1.05)).kind == "optimize"
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=1.2)) == Done("passed")
    # rollout.optimize_until overrides the evaluation's threshold
    cfg = load_config(None, ["rollout.optimize_until=1.5"])
    policy = TurnPolicy(TurnRules.from_config(cfg.rollout, cfg.model, cfg.eval), chat)
    assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=1.2)).kind == "optimize"
    # optimize_turns = 0: a pass ends the attempt, however slow
    cfg = load_config(None, ["rollout.optimize_turns=0"])
    policy = TurnPolicy(TurnRules.from_config(cfg.rollout, cfg.model, cfg.eval), chat)
    for speedup in (0.3, 1.05, 1.2):
        assert answer_turn(policy, first, ANSWER, verdict(passed=True, speedup=speedup)) == Done("passed")
    # first-turn rules (evaluation, checks, benchmarks) never follow up
    one = TurnPolicy(TurnRules.first_turn(cfg.rollout, cfg.model), chat)
    assert answer_turn(one, one.next_prompt(Attempt.of(RELU), None), ANSWER, verdict(passed=True, speedup=0.3)) == Done(
        "passed"
    )


def test_a_retry_task_opens_with_its_failed_answer_as_an_assistant_turn(chat):
    task = dataclasses.replace(
        RELU, repair=RepairContext(failed_code=ANSWER, feedback="BDR-FEEDBACK", attempt=1, origin_group="g1")
    )
    policy = TurnPolicy(TurnRules(max_turns=2, max_seq_len=4096, max_new_tokens=256), chat)
    first = policy.next_prompt(Attempt.of(task), None)
    assert first.kind == "repair" and [m.role for m in first.messages] == ["system", "user", "assistant", "user"]
    assert first.messages[2].content == ANSWER and "BDR-FEEDBACK" in first.messages[3].content
    second = answer_turn(policy, first, ANSWER + "\n# mine", verdict())
    assert second.attempt.turns == 1 and isinstance(second, Prompt)  # the inherited answer is not a turn
    assert answer_turn(policy, second, ANSWER, verdict()) == Done("failed")


def test_the_plain_format_for_a_tokenizer_without_a_template():
    task = Message("user", "Repeat: abc\n")
    assert plain_text([task]) == "Repeat: abc\n"  # a single turn is exactly its text
    dialogue = [
        Message("system", "Rules."),
        task,
        Message("assistant", "abd", reasoning="hmm"),
        Message("user", "Wrong answer."),
    ]
    assert plain_text(dialogue) == "Rules.\n\nRepeat: abc\n<think>\nhmm\n</think>\n\nabd\nFeedback: Wrong answer.\n"
    assert ByteTokenizer().render([task]) == [ByteTokenizer.bos_token_id, *b"Repeat: abc\n"]


def test_thinking_is_split_from_the_answer_and_only_the_answer_is_verified(chat):
    thought = "<think>\nfirst idea:\n```python\nclass ModelNew: pass  # inside the thinking\n```\n</think>\n\n"
    ids = chat.encode(thought + ANSWER) + [chat.end_of_turn_id]
    assert chat.split_response(ids) == Response(answer=ANSWER, reasoning=thought[8:-11].strip())
    assert chat.split_response(
        chat.encode("<think>\ncut off while thinking ```python\nclass ModelNew: ...")
    ) == Response(answer="", reasoning="cut off while thinking ```python\nclass ModelNew: ...")
    assert ByteTokenizer().split_response(ByteTokenizer().encode(thought + ANSWER)).answer == ANSWER

    class Recorder:  # the verifier's side of the loop: what was it asked to verify?
        requests: ClassVar[list[VerifyRequest]] = []

        async def verify(self, request):
            self.requests.append(request)
            return dataclasses.replace(verdict(passed=True), request_id=request.request_id)

    async def generate(r: GenerateRequest) -> Generation:
        out = np.asarray(ids, dtype=np.int64)
        return Generation(
            request_id=r.request_id,
            output_ids=out,
            logprobs=np.zeros(len(out), np.float32),
            versions=np.zeros(len(out), np.int64),
            finish_reason="stop",
        )

    recorder = Recorder()
    pipeline = Pipeline(
        actor_id="r",
        generate=generate,
        verify=recorder.verify,
        tokenizer=chat,
        params=SamplingParams(max_new_tokens=256),
        policy=TurnPolicy(TurnRules(max_turns=2, max_seq_len=4096, max_new_tokens=256), chat),
    )
    (episode,) = asyncio.run(pipeline.run_group(TaskReply(status="task", task=RELU, group_id="g", group_size=1)))
    assert [r.candidate for r in recorder.requests] == [ANSWER]
    turn = episode.turns[0]
    assert turn.text == ANSWER and "inside the thinking" in turn.reasoning  # the episode keeps the thinking
    assert decode(encode(episode)).turns[0].reasoning == turn.reasoning


def test_an_unservable_task_becomes_marked_episodes_that_replay_can_drop():
    tok = ByteTokenizer()

    async def never(request):
        pytest.fail("nothing to generate or verify")

    pipeline = Pipeline(
        actor_id="r",
        generate=never,
        verify=never,
        tokenizer=tok,
        params=SamplingParams(max_new_tokens=64),
        policy=TurnPolicy(TurnRules(max_turns=2, max_seq_len=200, max_new_tokens=64), tok),
    )
    episodes = asyncio.run(pipeline.run_group(TaskReply(status="task", task=RELU, group_id="g", group_size=2)))
    for ep in episodes:
        decode(encode(ep))
        assert "exceeds model.max_seq_len = 200" in ep.unservable and ep.turns[0].result.error_class == "infra"


def test_stop_ids_are_the_generation_configs_eos_and_the_templates_end_of_turn(chat, tiny_chat_model):
    from actors.rollout.torch_engine import TorchEngine
    from configs import ModelConfig

    end_of_text, end_of_turn = chat.tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert chat.stop_ids == [end_of_text, end_of_turn] and chat.end_of_turn_id == end_of_turn
    assert ByteTokenizer().stop_ids == [ByteTokenizer.eos_token_id]
    # A chat model ends its turn with <|im_end|>, which generation_config.json does not name: an engine
    # that stops only at the config's eos runs on to the length limit.
    model = ModelConfig(path=str(tiny_chat_model), max_seq_len=512)
    for stops, finish, length in (([end_of_text], "length", 12), (chat.stop_ids, "stop", 1)):
        engine = TorchEngine(model, max_batch=1, eos_token_ids=stops)
        bias = np.zeros(engine.vocab_size, np.float32)
        bias[end_of_turn] = 50.0  # this model always ends its turn at once
        import torch

        engine.model.lm_head.register_forward_hook(lambda mod, args, out, bias=bias: out + torch.from_numpy(bias))
        try:
            (gen,) = engine.generate(
                [GenerateRequest("r", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=12))]
            )
        finally:
            engine.close()
        assert (gen.finish_reason, len(gen.output_ids)) == (finish, length)


def test_history_keeps_earlier_thinking_only_when_asked(chat):
    rules = TurnRules(max_turns=3, max_seq_len=4096, max_new_tokens=256, enable_thinking=True)
    for keep in (False, True):
        policy = TurnPolicy(dataclasses.replace(rules, history_thinking=keep), chat)
        first = policy.next_prompt(Attempt.of(RELU), None)
        second = answer_turn(policy, first, ANSWER, verdict(), reasoning="EARLIER-THOUGHT")
        assert ("EARLIER-THOUGHT" in chat.decode_prompt(second.ids)) is keep


def test_an_hf_tokenizer_without_a_chat_template_uses_the_plain_format(tiny_chat_model, tmp_path):
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_chat_model / name, tmp_path / name)
    plain = HFTokenizer(str(tmp_path))  # the template lives in chat_template.jinja, which is not copied
    assert not plain.has_chat_template
    messages = [Message("system", "Rules."), Message("user", "Task.\n")]
    assert plain.render(messages) == plain.tok.encode("Rules.\n\nTask.\n")
    assert plain.stop_ids == [plain.tok.convert_tokens_to_ids("<|endoftext|>")]  # no template: no end of turn
