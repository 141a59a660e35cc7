"""Start-up checks: every bad path a run could trip over, found before anything starts.

`kiln train --dry-run` and `kiln train` (before it launches an actor) run the same checks, and each
problem is one line; any error stops the command with a non-zero exit:

* the model: `model.path` is a directory holding a config that loads, weights and a tokenizer that
  loads (a hub id is refused unless `model.allow_download`); an absent `model.path` is a warning in
  a dry run (the plan then comes from the model section, so a preset can be planned on a machine
  without its weights) and an error otherwise;
* the task set: it loads (the built-in loader or the `replay.task_source` plug-in, constructed with
  its `replay.task_source_args`); counts per level; every broken task file with its reason; an empty
  validation split is a warning; so is a task whose first prompt cannot fit `model.max_seq_len`
  (the rollouts would take it out of the feed);
* the reward actor (`verifier.reward_actor` with its `reward_actor_args`, or the kernel verifier)
  imports and constructs, which for the kernel verifier means its backend is available: a CUDA
  device for `cuda`, the C++ toolchain;
* the run root (`logging.root`) is writable;
* the staleness window can fill the engines: replay lets at most (η + 1)·B groups of G attempts be
  running or waiting to train (`decisions.staleness_bound`), so with fewer attempts than the torch
  engines' rows (`rollout.num_actors` × `rollout.max_batch`), some rows can never decode. A warning:
  a synchronous run (η = 0) may want it so.

Where: a local run (and every dry run) checks on this machine. On a Ray cluster (`cluster.address`)
the component checks run as Ray tasks scheduled like the component itself (`on_cluster`: the same
placement-group bundle and GPU share), so each runs on the node Ray places that component on; only
the run root is checked by the driver.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from actors.decisions import staleness_bound
from configs import (
    AlgoConfig,
    ConfigError,
    KilnConfig,
    LoggingConfig,
    ModelConfig,
    ReplayConfig,
    RolloutConfig,
    VerifierConfig,
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "note"]
    text: str  # one line

    def line(self) -> str:
        return f"kiln: {self.text}" if self.level == "note" else f"kiln: {self.level}: {self.text}"


class StartupError(RuntimeError):
    """The checks found errors; `findings` holds every line."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__("; ".join(f.text for f in findings if f.level == "error"))
        self.findings = findings


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


# ------------------------------------------------------------------------------------ checks


def check_model(model: ModelConfig, *, dry_run: bool = False) -> list[Finding]:
    """`model.path` holds a config, weights and a tokenizer that load (or `model.tokenizer` does)."""
    if not model.path:
        if model.tokenizer == "bytes":
            return []
        return _tokenizer_loads(model, f"model.tokenizer={model.tokenizer}")
    key = f"model.path={model.path}"
    path = Path(model.path).expanduser()
    if not path.exists():
        if _HUB_ID.match(model.path):
            if not model.allow_download:
                return [
                    Finding(
                        "error",
                        f"{key} is not a directory here and looks like a Hugging Face hub id; "
                        f"download it (`hf download {model.path} --local-dir DIR`) and set "
                        "model.path=DIR, or set model.allow_download=true",
                    )
                ]
            return _config_loads(model, key) or _tokenizer_loads(model, key)
        if dry_run:
            return [
                Finding("warning", f"{key} does not exist on this machine; the plan uses the model section's sizes")
            ]
        return [Finding("error", f"{key}: no such directory")]
    if not path.is_dir():
        return [Finding("error", f"{key} is a file; model.path names a checkpoint directory")]
    if not (path / "config.json").is_file():
        return [Finding("error", f"{key} holds no config.json: not an HF checkpoint directory")]
    problems = _config_loads(model, key)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(Finding("error", f"{key} holds no weights (*.safetensors or *.bin)"))
    return problems + _tokenizer_loads(model, key)


def check_tasks(
    replay: ReplayConfig, backend: str, model: ModelConfig | None = None, rollout: RolloutConfig | None = None
) -> list[Finding]:
    """The task set loads and splits; broken task files, an empty validation split and tasks whose
    prompt cannot fit are reported. With `model` and `rollout`, each task's first prompt is rendered
    by the run's tokenizer and checked against the turn policy's fit rule."""
    from actors.buffer.task_source import load_task_set, resolve_task_path
    from tasks.loader import TaskLoadError, scan

    findings: list[Finding] = []
    if replay.task_source is None:
        try:
            _, broken = scan(resolve_task_path(replay.tasks))
        except TaskLoadError as err:
            return [Finding("error", f"replay.tasks={replay.tasks}: {err}")]
        findings += [Finding("error", f"replay.tasks: broken task {b.path}: {b.reason}") for b in broken]
    try:
        tasks = load_task_set(replay, backend)
    except ConfigError as err:
        return findings + [Finding("error", _one_line(err))]
    everything = tasks.train + tasks.val
    levels = Counter(f"level{t.kernel.level}" if t.kernel is not None else t.kind for t in everything)
    source = replay.task_source or replay.tasks
    findings.append(
        Finding(
            "note",
            f"tasks: {len(everything)} from {source} ("
            + ", ".join(f"{k}: {n}" for k, n in sorted(levels.items()))
            + f"); {len(tasks.train)} train, {len(tasks.val)} validation",
        )
    )
    if not tasks.val:
        findings.append(
            Finding(
                "warning",
                f"the validation split is empty (replay.val_fraction={replay.val_fraction}): "
                "evaluations will have nothing to measure",
            )
        )
    if model is not None and rollout is not None:
        findings += _prompt_fit(everything, model, rollout)
    return findings


def check_reward_actor(verifier: VerifierConfig, *, dry_run: bool = False) -> list[Finding]:
    """The reward actor imports and constructs with its arguments (the kernel verifier: its backend's
    device and toolchain are there), then is closed again. A dry run plans GPU presets on machines
    without a GPU: there, a cuda verifier without a visible device is a warning."""
    from actors.base import PluginError, load_plugin
    from actors.verifier.interface import DEFAULT_REWARD_ACTOR, RewardActor

    if dry_run and verifier.reward_actor is None and verifier.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return [
                Finding(
                    "warning",
                    "verifier.backend=cuda: no CUDA device is visible on this machine; the "
                    "verifiers must run where there is one",
                )
            ]
    name = verifier.reward_actor or DEFAULT_REWARD_ACTOR
    try:
        cls = load_plugin(name, RewardActor, key="verifier.reward_actor")
    except PluginError as err:
        return [Finding("error", _one_line(err))]
    try:
        impl = cls(verifier, **verifier.reward_actor_args)
    except Exception as err:  # noqa: BLE001 - a plug-in's constructor may raise anything; it becomes a finding
        what = (
            f"verifier.backend={verifier.backend} is not available here"
            if verifier.reward_actor is None
            else f"verifier.reward_actor={name} with reward_actor_args={dict(verifier.reward_actor_args)}"
        )
        return [Finding("error", f"{what}: constructing {cls.__name__} raised {type(err).__name__}: {_one_line(err)}")]
    try:
        impl.close()
    except Exception as err:  # noqa: BLE001 - a plug-in's close() may raise anything; a warning
        return [
            Finding("warning", f"verifier.reward_actor={name}: close() raised {type(err).__name__}: {_one_line(err)}")
        ]
    return []


def check_remote_verifier(verifier: VerifierConfig, *, dry_run: bool = False) -> list[Finding]:
    """The verifier service of `verifier.remote` answers its health check with a verifier serving,
    and verifies for the run's backend (a run's cuda tasks judged on a cpu service would be wrong)."""
    from protocols.verifier_client import ServiceError, VerifierClient

    try:
        health = VerifierClient(verifier.remote, timeout_s=10.0).health()
    except ServiceError as err:
        level = "warning" if dry_run else "error"
        return [Finding(level, f"verifier.remote={verifier.remote}: {err.message}")]
    if health.get("status") != "healthy":
        return [Finding("error", f"verifier.remote={verifier.remote}: the service has no verifier serving")]
    if health.get("backend") != verifier.backend:
        return [
            Finding(
                "error",
                f"verifier.remote={verifier.remote} verifies on {health.get('backend')!r}, the run's "
                f"verifier.backend is {verifier.backend!r}",
            )
        ]
    return []


def check_verifier(verifier: VerifierConfig, *, dry_run: bool = False) -> list[Finding]:
    """The run's verifier: the remote service, or the reward actor its own verifier actors build."""
    if verifier.remote:
        return check_remote_verifier(verifier, dry_run=dry_run)
    return check_reward_actor(verifier, dry_run=dry_run)


def check_run_root(logging_cfg: LoggingConfig) -> list[Finding]:
    """Run directories can be created under `logging.root` (probed with a temporary directory in the
    root, or in its nearest existing parent; nothing is left behind)."""
    root = Path(logging_cfg.root).expanduser()
    probe_in = root
    while not probe_in.exists() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        return [Finding("error", f"logging.root={logging_cfg.root} is not writable: {probe_in} is a file")]
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=probe_in))
    except OSError as err:
        return [Finding("error", f"logging.root={logging_cfg.root} is not writable: {err.strerror} ({probe_in})")]
    return []


def check_window(algo: AlgoConfig, rollout: RolloutConfig) -> list[Finding]:
    """A warning when the staleness window holds fewer attempts than the torch engines have rows."""
    if rollout.engine != "torch":  # an SGLang server sizes its own running batch
        return []
    groups = staleness_bound(algo.max_staleness, 0, algo.batch_groups, algo.total_steps)
    window, rows = groups * algo.group_size, rollout.num_actors * rollout.max_batch
    if window >= rows:
        return []
    return [
        Finding(
            "warning",
            f"the staleness window admits at most (η + 1)·B·G = {window} attempts at a time (algo.max_staleness "
            f"{algo.max_staleness}, batch_groups {algo.batch_groups}, group_size {algo.group_size}), fewer than the "
            f"engines' {rows} rows ({rollout.num_actors} × rollout.max_batch {rollout.max_batch}): at most "
            f"{window / rows:.0%} of them can decode at once, fewer while attempts wait on verifiers",
        )
    ]


# ----------------------------------------------------------------------------------- running

# What each component checks where it runs: (component, role in the placement plan, check, its config)
Component = tuple[str, str, Callable[..., list[Finding]], tuple]


def components(cfg: KilnConfig) -> list[Component]:
    return [
        ("replay", "replay", check_tasks, (cfg.replay, cfg.verifier.backend, cfg.model, cfg.rollout)),
        ("verifier-0", "verifier", check_verifier, (cfg.verifier,)),
        ("learner", "learner", check_model, (cfg.model,)),
        ("rollout-0", "rollout", check_model, (cfg.model,)),
    ]


def local_checks(cfg: KilnConfig, *, dry_run: bool, with_components: bool = True) -> list[Finding]:
    """Every check on this machine (`with_components=False`: the run root only, for a cluster run
    whose components are checked where they run)."""
    findings = check_run_root(cfg.logging) + check_window(cfg.algo, cfg.rollout)
    if with_components:
        findings += check_model(cfg.model, dry_run=dry_run)
        findings += check_tasks(
            cfg.replay, cfg.verifier.backend, cfg.model if not errors(findings) else None, cfg.rollout
        )
        findings += check_verifier(cfg.verifier, dry_run=dry_run)
    return findings


def on_cluster(cfg: KilnConfig, placement, ray_options: Callable, timeout_s: float = 600.0) -> list[Finding]:
    """The component checks as Ray tasks, each scheduled like its component (`ray_options(slot, prefer)`:
    the placement group bundle of its GPUs, or its preferred node, as `Supervisor.ray_options` gives the
    actor); findings are prefixed with the component's name. The model check of a component that
    failed already is reported once."""
    import ray

    from actors.base import Slot
    from launch.driver.plan import actor_slot

    pending = []
    for name, role, check, args in components(cfg):
        slot = actor_slot(placement, role, 0) if role != "replay" else None
        gpus = slot.num_gpus if slot is not None else 0
        task = ray.remote(num_cpus=0, num_gpus=gpus)(check)
        options = ray_options(slot or Slot(), cfg.cluster.prefer_nodes.get(role, ""))
        pending.append((name, task.options(**options).remote(*args)))
    findings, seen = [], set()
    for name, ref in pending:
        for f in ray.get(ref, timeout=timeout_s):
            if f.text not in seen:
                seen.add(f.text)
                findings.append(Finding(f.level, f"{name}: {f.text}"))
    return findings


def verify_problem(backend: str, tasks_dir: str | None, jobs: list) -> str:
    """`kiln verify`'s entry guard: one line naming what makes the command unable to run ("" when
    nothing does): a cuda backend without a CUDA device, broken task files under --tasks, a reference
    whose get_init_inputs() or get_inputs() raises. `jobs` are (Task, candidate text or None)."""
    if backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return (
                "backend cuda needs a CUDA device and none is visible on this machine "
                "(torch.cuda.is_available() is False); use --backend cpu"
            )
    if tasks_dir:
        from tasks.loader import scan

        _, broken = scan(tasks_dir)
        if broken:
            return f"{len(broken)} broken task file{'s' if len(broken) > 1 else ''} in {tasks_dir}: " + "; ".join(
                f"{b.path}: {b.reason}" for b in broken
            )
    from tasks.loader import probe_reference

    for task, candidate in jobs:
        if candidate is None or task.kernel is None:
            continue
        name = task.kernel.source_path or task.task_id
        why = probe_reference(task.kernel.reference, name, backend)
        if why:
            return f"the reference {name} is broken: {why}"
    return ""


# ----------------------------------------------------------------------------------- helpers


def _config_loads(model: ModelConfig, key: str) -> list[Finding]:
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model.path, local_files_only=not model.allow_download)
    except Exception as err:  # noqa: BLE001 - any failure to load is a finding, not a crash of the check
        return [Finding("error", f"{key}: its config does not load: {type(err).__name__}: {_one_line(err)}")]
    return []


def _tokenizer_loads(model: ModelConfig, key: str) -> list[Finding]:
    from actors.policy.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except Exception as err:  # noqa: BLE001 - any failure to load is a finding, not a crash of the check
        return [Finding("error", f"{key}: its tokenizer does not load: {type(err).__name__}: {_one_line(err)}")]
    if not tokenizer.has_chat_template:
        return [Finding("warning", f"{key}: the tokenizer has no chat template; prompts use Kiln's plain format")]
    return []


def _prompt_fit(tasks, model: ModelConfig, rollout: RolloutConfig) -> list[Finding]:
    from actors.policy.tokenizer import load_tokenizer
    from actors.rollout.turns import Attempt, Done, TurnPolicy, TurnRules

    try:
        policy = TurnPolicy(TurnRules.first_turn(rollout, model), load_tokenizer(model))
    except Exception:  # noqa: BLE001 - the model check reports why the tokenizer does not load
        return []
    unfit = []
    for task in tasks:
        first = policy.next_prompt(Attempt.of(task), None)
        if isinstance(first, Done):
            unfit.append(
                Finding(
                    "warning",
                    f"task {task.task_id} cannot be posed: {first.detail}; the rollouts will take it out of the feed",
                )
            )
    if unfit and len(unfit) == len(tasks):
        return [
            Finding(
                "error",
                f"no task's first prompt fits: raise model.max_seq_len or lower "
                f"rollout.max_new_tokens ({unfit[0].text})",
            )
        ]
    return unfit


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
