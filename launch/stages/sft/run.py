"""The `kiln sft` training loop: epochs of packed batches through `Trainer.sft_step` (the learner's
own SFT step over the torch or megatron backend, as RL's steps go through it), a held-out loss,
checkpoints, HF exports and resume.

Layout of the output directory:
  metrics.jsonl, tb/         one row per step (sft/loss, sft/grad_norm, ...), held-out rows when measured
  checkpoints/step-NNNNNN/   the learner backend's state (model, optimizer, RNG) and meta.json
  exports/step-NNNNNN/       servable HF exports every `export_every` steps
  final/                     the servable HF export after the last step
  report.md, plots/          written by launch.stages.sft.report

Steps are numbered over the whole run: epoch e's batches are the training sequences shuffled with
seed (seed, e) and packed first-fit, so the batches of every epoch are known up front and a resumed
run (the latest checkpoint's step) continues with the next batch of the same order. The learning
rate is constant (`--lr`).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actors.learner.algorithm import Trainer
from actors.learner.backends import make_trainer
from actors.learner.checkpoint import CHECKPOINTS, CheckpointMeta, read_latest, step_dir_name, write_checkpoint
from actors.learner.sft_data import pack_sequences
from actors.policy.chat_tokens import TokenSequence
from actors.policy.export import GenerationSettings, export_servable
from configs import KilnConfig
from launch.observe.metrics import MetricsLog
from launch.stages.sft.data import SFTData
from protocols import TrainBatch
from protocols import metric_keys as mk

FINAL = "final"
EXPORTS = "exports"


@dataclass(frozen=True)
class SFTSettings:
    """The loop's knobs (`kiln sft`'s flags)."""

    out: Path
    epochs: int = 1
    lr: float = 1e-4
    batch_tokens: int = 16384  # tokens per packed batch (one optimizer step)
    eval_every: int = 0  # steps between held-out losses; 0 = at the end of each epoch only
    export_every: int = 0  # steps between HF exports under out/exports/; 0 = out/final only
    checkpoint_every: int = 0  # steps between checkpoints; 0 = at each export and epoch end
    seed: int = 0  # the held-out split and the per-epoch shuffle


@dataclass
class SFTResult:
    steps: int  # steps of the whole run (resumed ones included)
    resumed_from: int  # the step the run continued from (0 = a fresh start)
    first_loss: float | None
    final_loss: float | None
    held_out: list[tuple[int, float]]  # (step, held-out loss), this session's
    final: Path
    seconds: float


def epoch_batches(train: list[TokenSequence], settings: SFTSettings, epoch: int) -> list[TrainBatch]:
    order = list(train)
    random.Random(f"{settings.seed}/{epoch}").shuffle(order)
    return pack_sequences(order, settings.batch_tokens)


def held_out_loss(trainer: Trainer, batches: list[TrainBatch]) -> float | None:
    """Mean cross-entropy (nats per token) of the held-out responses under the current weights."""
    total, count = 0.0, 0
    for batch in batches:
        logprobs = trainer.logprobs(batch, 1.0).numpy()
        mask = np.asarray(batch.loss_mask, dtype=bool)
        total -= float(logprobs[mask].sum())
        count += int(mask.sum())
    return total / count if count else None


class SFTRun:
    """One `kiln sft` run over prepared data; `run(progress)` trains to the end (or resumes to it)."""

    def __init__(self, cfg: KilnConfig, data: SFTData, settings: SFTSettings, *, device: str) -> None:
        self.cfg, self.data, self.s = cfg, data, settings
        algo = dataclasses.replace(cfg.algo, kl_coef=0.0)  # supervised: no reference model
        learner = dataclasses.replace(cfg.learner, lr=settings.lr)
        self.trainer = make_trainer(cfg.model, learner, algo, temperature=1.0, device=device)
        self.generation = GenerationSettings.from_rollout(cfg.rollout)
        self.epochs = [epoch_batches(data.train, settings, e) for e in range(settings.epochs)]
        self.total = sum(len(b) for b in self.epochs)
        self.held_batches = pack_sequences(data.held_out, settings.batch_tokens)

    def resume(self) -> int:
        """Load the latest checkpoint under the output directory; the step it holds (0 when none)."""
        latest = read_latest(self.s.out)
        if latest is None:
            return 0
        state, meta = latest
        self.trainer.load_checkpoint(state)
        return meta.step

    def run(self, metrics: MetricsLog, on_step: Callable[[int, int, dict], None]) -> SFTResult:
        started = time.monotonic()
        done = self.resume()
        step, first, last, held = done, None, None, []
        for epoch, batches in enumerate(self.epochs):
            before = sum(len(b) for b in self.epochs[:epoch])
            for i, batch in enumerate(batches):
                global_step = before + i + 1
                if global_step <= done:
                    continue
                result = self.trainer.sft_step(batch, lr=self.s.lr)
                step = global_step
                first = result.loss if first is None else first
                last = result.loss
                row = {
                    mk.SFT_LOSS: result.loss,
                    mk.SFT_GRAD_NORM: result.grad_norm,
                    mk.SFT_TOKENS: result.tokens,
                    mk.SFT_TRAINED_TOKENS: result.trained_tokens,
                    mk.SFT_STEP_S: result.seconds,
                    mk.SFT_EPOCH: epoch + (i + 1) / len(batches),
                    mk.SFT_LR: self.s.lr,
                }
                end_of_epoch = i + 1 == len(batches)
                if self.held_batches and (end_of_epoch or (self.s.eval_every and step % self.s.eval_every == 0)):
                    loss = held_out_loss(self.trainer, self.held_batches)
                    if loss is not None:
                        row[mk.SFT_HELDOUT_LOSS] = loss
                        held.append((step, loss))
                metrics.log(step, row)
                on_step(step, self.total, row)
                exporting = bool(self.s.export_every) and step % self.s.export_every == 0
                if exporting:
                    self.export(self.s.out / EXPORTS / step_dir_name(step))
                if exporting or end_of_epoch or (self.s.checkpoint_every and step % self.s.checkpoint_every == 0):
                    self.checkpoint(step)
        final = self.s.out / FINAL
        if step > done or not final.is_dir():
            self.export(final)
        return SFTResult(
            steps=self.total,
            resumed_from=done,
            first_loss=first,
            final_loss=last,
            held_out=held,
            final=final,
            seconds=time.monotonic() - started,
        )

    def checkpoint(self, step: int) -> None:
        """Save the state at `step` and drop older checkpoints (resume needs only the latest)."""
        path = write_checkpoint(self.s.out, self.trainer, CheckpointMeta(version=step, step=step, time=time.time()))
        for old in (self.s.out / CHECKPOINTS).glob("step-*"):
            if old != path and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def export(self, path: Path) -> Path:
        return export_servable(path, self.trainer.export_hf, self.cfg.model, self.generation)
