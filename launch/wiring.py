"""Which actors a run has and how they find each other: one `ActorSpec` per actor, built from the
config and the run directory.

Peers find replay and the learner through endpoint files in the run directory (`read_endpoint`),
so a restarted replay or learner, which binds new ports, is found again without re-wiring anyone.
A restarted learner resumes from its last checkpoint above every version replay has seen.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from actors.buffer.actor import ReplayActor, read_endpoint
from actors.learner.actor import LearnerActor, read_learner_endpoints
from actors.rollout.actor import RolloutActor
from actors.rollout.engines import resolve_device
from actors.verifier.actor import VerifierActor
from configs import KilnConfig
from launch.supervisor import ActorSpec, Handle, Supervisor


def gpu_share(cfg: KilnConfig, role: str) -> float:
    """GPUs Ray reserves for one actor of `role` (0 on a CPU-only run)."""
    if not cfg.cluster.num_gpus and cfg.cluster.num_gpus is not None:
        return 0.0
    colocated = cfg.cluster.layout == "colocated"
    cuda_verifier = cfg.verifier.backend == "cuda"
    # Colocated: learner, engine (and a cuda verifier) share one GPU; Ray must still make it visible
    # to each of them, so each holds a fraction.
    share = (1 / 3 if cuda_verifier else 0.5) if colocated else 1.0
    if role == "verifier":
        return share if cuda_verifier else 0.0
    if role == "learner":
        return 0.0 if resolve_device(cfg.learner.device) == "cpu" else share
    if role == "rollout":
        return 0.0 if resolve_device(cfg.rollout.device) == "cpu" else share
    return 0.0


def replay_spec(cfg: KilnConfig, run_dir: Path, *, max_staleness: int | None = None) -> ActorSpec:
    replay = cfg.replay if max_staleness is None else dataclasses.replace(cfg.replay, max_staleness=max_staleness)
    c = cfg.cluster
    return ActorSpec(name="replay", cls=ReplayActor, num_cpus=0, kwargs=lambda: dict(
        replay=replay, algo=cfg.algo, run_dir=str(run_dir), backend=cfg.verifier.backend,
        host=c.bind_host, transport=c.transport, advertise=c.advertise_host))


def verifier_specs(cfg: KilnConfig) -> list[ActorSpec]:
    c = cfg.cluster
    return [ActorSpec(name=f"verifier-{i}", cls=VerifierActor, num_cpus=0, num_gpus=gpu_share(cfg, "verifier"),
                      kwargs=lambda: dict(cfg=cfg.verifier, host=c.bind_host, transport=c.transport,
                                          advertise=c.advertise_host))
            for i in range(cfg.verifier.num_actors)]


def learner_spec(cfg: KilnConfig, run_dir: Path, supervisor: Supervisor, monitor: str, *,
                 resume: bool) -> ActorSpec:
    def kwargs() -> dict:
        # A restart (or --resume) continues from the last checkpoint, above every version replay saw.
        restarting = resume or "learner" in supervisor.handles
        min_version = 0
        if restarting and "replay" in supervisor.handles:
            min_version = supervisor["replay"].call("health")["highest_version_seen"] + 1
        return dict(model=cfg.model, learner=cfg.learner, algo=cfg.algo, temperature=cfg.rollout.temperature,
                    run_dir=str(run_dir), replay=functools.partial(read_endpoint, str(run_dir)), metrics=monitor,
                    device=resolve_device(cfg.learner.device), host=cfg.cluster.bind_host, resume=restarting,
                    min_version=min_version, confirm_before_next=cfg.replay.max_staleness == 0,
                    shares_gpu=cfg.cluster.layout == "colocated")

    return ActorSpec(name="learner", cls=LearnerActor, num_cpus=0, num_gpus=gpu_share(cfg, "learner"),
                     kwargs=kwargs)


def rollout_specs(cfg: KilnConfig, run_dir: Path, supervisor: Supervisor, monitor: str, *,
                  with_learner: bool, episode_log: Path | None = None) -> list[ActorSpec]:
    def kwargs(i: int) -> dict:
        verifiers = [h.endpoints["verifier"] for h in supervisor.role("verifier-")]
        return dict(rollout=cfg.rollout, model=cfg.model, replay=functools.partial(read_endpoint, str(run_dir)),
                    verifier=",".join(verifiers), actor_id=f"rollout-{i}", index=i,
                    learner=functools.partial(read_learner_endpoints, str(run_dir)) if with_learner else None,
                    metrics=monitor, episodes_to_driver=cfg.logging.episodes_per_step,
                    episode_log=None if episode_log is None else str(episode_log / f"rollout-{i}.kiln"))

    return [ActorSpec(name=f"rollout-{i}", cls=RolloutActor, num_cpus=0, num_gpus=gpu_share(cfg, "rollout"),
                      kwargs=functools.partial(kwargs, i))
            for i in range(cfg.rollout.num_actors)]


def busy_fractions(supervisor: Supervisor, previous: dict[str, float], seconds: float) -> dict[str, float]:
    """Per-actor share of the last `seconds` spent working, from the actors' `busy_s` counters."""
    out = {}
    for name, handle in supervisor.handles.items():
        try:
            busy = float(handle.call("health", timeout_s=10.0).get("busy_s", float("nan")))
        except Exception:
            continue
        if busy == busy and name in previous and seconds > 0:
            out[f"busy/{name}"] = min(1.0, max(0.0, (busy - previous[name]) / seconds))
        previous[name] = busy
    return out


def write_endpoints(run_dir: Path, handles: dict[str, Handle]) -> None:
    """Every actor's endpoints, for people and tools attaching to a run."""
    (run_dir / "endpoints.json").write_text(json.dumps({n: h.endpoints for n, h in handles.items()}, indent=1))
