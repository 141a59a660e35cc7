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
from actors.policy.weights.group import free_port
from actors.rollout.actor import RolloutActor
from actors.rollout.engines import resolve_device
from actors.verifier.actor import VerifierActor
from configs import KilnConfig
from launch.plan import learner_ranks, plan
from launch.supervisor import ActorSpec, Handle, Supervisor


def gpu_share(cfg: KilnConfig, role: str, index: int = 0) -> float:
    """GPUs Ray reserves for actor `index` of `role`: its share of each GPU the placement plan gives it
    (colocated residents split a GPU equally, as do verifier actors on one dedicated GPU), 0 on CPU."""
    if role == "learner" and resolve_device(cfg.learner.device) == "cpu":
        return 0.0
    if role == "rollout" and resolve_device(cfg.rollout.device) == "cpu":
        return 0.0
    p = plan(cfg, check_fit=False)
    if role == "learner":
        return p.learner[index].gpu_fraction
    if role == "rollout":
        slot = p.engines[index]
        return 0.0 if slot.external_url else slot.gpu_fraction * len(slot.gpus)
    if role == "verifier":
        return p.verifiers[index].gpu_fraction
    return 0.0


def replay_spec(cfg: KilnConfig, run_dir: Path, *, max_staleness: int | None = None) -> ActorSpec:
    replay = cfg.replay if max_staleness is None else dataclasses.replace(cfg.replay, max_staleness=max_staleness)
    c = cfg.cluster
    return ActorSpec(name="replay", cls=ReplayActor, num_cpus=0, kwargs=lambda: dict(
        replay=replay, algo=cfg.algo, run_dir=str(run_dir), backend=cfg.verifier.backend,
        host=c.bind_host, transport=c.transport, advertise=c.advertise_host))


def verifier_specs(cfg: KilnConfig) -> list[ActorSpec]:
    c = cfg.cluster
    return [ActorSpec(name=f"verifier-{i}", cls=VerifierActor, num_cpus=0, num_gpus=gpu_share(cfg, "verifier", i),
                      kwargs=lambda: dict(cfg=cfg.verifier, host=c.bind_host, transport=c.transport,
                                          advertise=c.advertise_host))
            for i in range(cfg.verifier.num_actors)]


def learner_specs(cfg: KilnConfig, run_dir: Path, supervisor: Supervisor, monitor: str, *,
                  resume: bool, warm_start: bool = False) -> list[ActorSpec]:
    """One spec per learner rank: "learner" (rank 0, the one peers talk to), then "learner-1", ...
    They start and restart together (`group`); each (re)start gets a fresh rendezvous port. With
    `warm_start` (and algo.sft_warmup_steps) the first start leaves version 0 to the driver's warm start."""
    world = learner_ranks(cfg)
    rendezvous = {"master": ""}

    def kwargs(rank: int) -> dict:
        if rank == 0:  # called first at every (re)start of the group
            host = cfg.cluster.advertise_host or cfg.cluster.bind_host
            rendezvous["master"] = f"{host}:{free_port(cfg.cluster.bind_host)}"
        # A restart (or --resume) continues from the last checkpoint, above every version replay saw.
        restarting = resume or "learner" in supervisor.handles
        min_version = 0
        if rank == 0 and restarting and "replay" in supervisor.handles:
            min_version = supervisor["replay"].call("health")["highest_version_seen"] + 1
        return dict(model=cfg.model, learner=cfg.learner, algo=cfg.algo, temperature=cfg.rollout.temperature,
                    run_dir=str(run_dir), replay=functools.partial(read_endpoint, str(run_dir)), metrics=monitor,
                    device=resolve_device(cfg.learner.device), host=cfg.cluster.bind_host, resume=restarting,
                    min_version=min_version, confirm_before_next=cfg.replay.max_staleness == 0,
                    shares_gpu=cfg.cluster.layout == "colocated", rank=rank, world_size=world,
                    master=rendezvous["master"], learner_id="learner-0" if rank == 0 else f"learner-0.rank{rank}",
                    warm_start_follows=warm_start and not restarting and cfg.algo.sft_warmup_steps > 0)

    return [ActorSpec(name="learner" if rank == 0 else f"learner-{rank}", cls=LearnerActor, num_cpus=0,
                      num_gpus=gpu_share(cfg, "learner", rank), kwargs=functools.partial(kwargs, rank),
                      group="learner" if world > 1 else None)
            for rank in range(world)]


def rollout_specs(cfg: KilnConfig, run_dir: Path, supervisor: Supervisor, monitor: str, *,
                  with_learner: bool, episode_log: Path | None = None) -> list[ActorSpec]:
    def kwargs(i: int) -> dict:
        verifiers = [h.endpoints["verifier"] for h in supervisor.role("verifier-")]
        return dict(rollout=cfg.rollout, model=cfg.model, replay=functools.partial(read_endpoint, str(run_dir)),
                    verifier=",".join(verifiers), actor_id=f"rollout-{i}", index=i,
                    learner=functools.partial(read_learner_endpoints, str(run_dir)) if with_learner else None,
                    metrics=monitor, episodes_to_driver=cfg.logging.episodes_per_step,
                    episode_log=None if episode_log is None else str(episode_log / f"rollout-{i}.kiln"))

    return [ActorSpec(name=f"rollout-{i}", cls=RolloutActor, num_cpus=0, num_gpus=gpu_share(cfg, "rollout", i),
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
            # A counter that went down belongs to a restarted actor: all of it is since the last reading.
            worked = busy - previous[name] if busy >= previous[name] else busy
            out[f"busy/{name}"] = min(1.0, worked / seconds)
        previous[name] = busy
    return out


def write_endpoints(run_dir: Path, handles: dict[str, Handle]) -> None:
    """Every actor's endpoints, for people and tools attaching to a run."""
    (run_dir / "endpoints.json").write_text(json.dumps({n: h.endpoints for n, h in handles.items()}, indent=1))
