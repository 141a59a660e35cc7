"""TRL's own GRPOTrainer, one optimisation step on the tiny chat model, whose reward is Kiln's verifier
service through the TRL adapter (protocols/verifier_adapters.py TrlReward, configured from
KILN_SERVE_URL / KILN_SERVE_TOKEN as docs/verifier.md's example is): every completion is sent to a
real `kiln serve` over HTTP, and the reward TRL records for each is the service's answer for it.

The service's verifiers run the paced stand-in reward actor (paced.py: a completion with the word
"pass" passes, 1.0; anything else fails, -1.0), so the step's reward depends only on what the model
wrote. TRL 1.16.0 is a test-only dependency, pinned (pyproject.toml): the check reads the trainer's
record of each completion's reward (`_logs`), which is its internal state."""

from __future__ import annotations

import math
import re
import urllib.request

import pytest
import torch

from configs import load_config
from launch.serve.cli import start
from protocols.verifier_client import VerifierClient

TOKEN = "trl-client-token-0123456789"
REFERENCE = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"


@pytest.fixture
def service(tmp_path, monkeypatch):
    (tmp_path / "tokens").write_text(f"trl {TOKEN}\n")
    running = start(
        load_config(
            None,
            [
                "verifier.reward_actor=tests.launch.serve.paced.PacedReward",
                "serve.port=0",
                f"serve.token_file={tmp_path / 'tokens'}",
                "serve.verifiers=2",
            ],
        )
    )
    monkeypatch.setenv("KILN_SERVE_URL", running.url)
    monkeypatch.setenv("KILN_SERVE_TOKEN", TOKEN)
    yield running
    running.stop()


def verdicts(url: str) -> dict[str, float]:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'kiln_serve_verdicts_total\{verdict="([^"]+)"\} (\S+)', text)}


def test_one_grpo_step_of_trl_rewarded_by_the_service(service, tiny_chat_model, tmp_path):
    # Mutation: score a completion by its prompt instead of its last message in TrlReward.__call__ ->
    # the service judges other text than TRL's completion, and the one-to-one check fails.
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from protocols.verifier_adapters import TrlReward

    answered: dict[str, float] = {}  # what the service answered, by the text it judged

    class Recording(VerifierClient):
        def verify(self, candidate, reference=None, task_id=None, deadline_s=None):
            r = super().verify(candidate, reference=reference, task_id=task_id, deadline_s=deadline_s)
            answered[candidate] = r.score
            return r

    reward = TrlReward()  # from the environment, as the docs' example
    reward.client = Recording(reward.client.url, reward.client.token)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    # Sampling tilted towards " pass" (a standard generation option), so that one step may see both
    # verdicts; the check below holds whatever the mix.
    space, rest = tokenizer.encode(" pass", add_special_tokens=False)
    prompts = [
        {"prompt": [{"role": "user", "content": "Write a faster identity."}], "reference": REFERENCE},
        {"prompt": [{"role": "user", "content": "Write it again, faster."}], "reference": REFERENCE},
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=4,  # 2 prompts x 2 generations
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-4,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # nothing to save on a 2-layer model
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        generation_kwargs={"sequence_bias": {(space,): 7.0, (space, rest): 20.0}},
    )
    before = verdicts(service.url)
    trainer = GRPOTrainer(
        model=str(tiny_chat_model),
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    trainer.train()

    served = sum(verdicts(service.url).values()) - sum(before.values())
    per_completion = list(trainer._logs["rewards"]["kiln_verifier"])  # TRL's record of each reward
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in trainer._logs["completion"]]
    assert len(per_completion) == 4 and served == 4 and len(answered) == len(set(texts))
    assert [answered[t] for t in texts] == per_completion  # each reward is the service's answer for it
    logged = next(e for e in trainer.state.log_history if "reward" in e)
    mean = sum(per_completion) / 4
    assert logged["reward"] == pytest.approx(mean) and logged["rewards/kiln_verifier/mean"] == pytest.approx(mean)
    assert math.isfinite(logged["grad_norm"])
    torch.set_num_threads(1)  # the trainer may have changed it; the rest of the worker's tests expect one
