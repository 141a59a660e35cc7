"""Which actors a run has: one `ActorSpec` per actor, from the config sections it reads and its slot in
the placement plan. Nothing here knows a peer's address (actors find each other in the run's
registry) or decides anything about the algorithm (the actors do), so a restarted actor is built from
the same spec as the first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from actors.buffer.actor import ReplayActor
from actors.buffer.offline import OfflineReplayActor
from actors.learner.actor import LearnerActor
from actors.policy.export import GenerationSettings
from actors.rollout.actor import RolloutActor
from actors.verifier.actor import VerifierActor
from configs import KilnConfig, WarmStartConfig
from launch.driver.handles import LearnerHandle, ReplayHandle, RolloutHandle, VerifierHandle
from launch.driver.plan import PlacementPlan, actor_slot, learner_ranks
from launch.driver.supervisor import ActorSpec


def replay_spec(cfg: KilnConfig) -> ActorSpec:
    return ActorSpec(
        name="replay",
        cls=ReplayActor,
        handle=ReplayHandle,
        args=(cfg.replay, cfg.algo),
        kwargs={"backend": cfg.verifier.backend},
        prefer_node=cfg.cluster.prefer_nodes.get("replay", ""),
    )


def offline_replay_spec(cfg: KilnConfig, episodes: Path) -> ActorSpec:
    return ActorSpec(
        name="replay",
        cls=OfflineReplayActor,
        handle=ReplayHandle,
        args=(str(episodes), cfg.algo),
        prefer_node=cfg.cluster.prefer_nodes.get("replay", ""),
    )


def verifier_specs(cfg: KilnConfig, placement: PlacementPlan) -> list[ActorSpec]:
    """The run's verifier actors: none when a verifier service verifies its attempts (verifier.remote)."""
    if cfg.verifier.remote:
        return []
    return [
        ActorSpec(
            name=f"verifier-{i}",
            cls=VerifierActor,
            handle=VerifierHandle,
            args=(cfg.verifier,),
            rank=i,
            world_size=cfg.verifier.num_actors,
            slot=actor_slot(placement, "verifier", i),
            prefer_node=cfg.cluster.prefer_nodes.get("verifier", ""),
        )
        for i in range(cfg.verifier.num_actors)
    ]


def learner_specs(cfg: KilnConfig, placement: PlacementPlan) -> list[ActorSpec]:
    """One spec per learner rank: "learner" (rank 0, the one peers talk to), then "learner-1", ...
    They start and restart together (`group`)."""
    world = learner_ranks(cfg)
    sections = (cfg.model, cfg.learner, cfg.algo, warm_start_section(cfg))
    settings = {
        "temperature": cfg.rollout.temperature,
        "generation": GenerationSettings.from_rollout(cfg.rollout),
    }
    slots = [actor_slot(placement, "learner", rank) for rank in range(world)]
    # A warm standby only where a restart pays for a new process (Ray), and where the spare costs no GPU
    # memory and restarts alone: one rank, no GPU.
    standby = cfg.learner.standby and cfg.cluster.use_ray and world == 1 and not slots[0].gpus and not slots[0].num_gpus
    return [
        ActorSpec(
            name="learner" if rank == 0 else f"learner-{rank}",
            cls=LearnerActor,
            handle=LearnerHandle,
            args=sections,
            kwargs=settings,
            rank=rank,
            world_size=world,
            slot=slots[rank],
            group="learner" if world > 1 else None,
            standby=standby,
            prefer_node=cfg.cluster.prefer_nodes.get("learner", ""),
        )
        for rank in range(world)
    ]


def rollout_specs(
    cfg: KilnConfig, placement: PlacementPlan, *, follow_learner: bool = True, episode_log: bool = False
) -> list[ActorSpec]:
    settings = {
        "follow_learner": follow_learner,
        "send_episodes": cfg.logging.episodes_per_step > 0,
        "episode_log": episode_log,
        "remote_verifier": cfg.verifier.remote,
    }
    slots = [actor_slot(placement, "rollout", i) for i in range(cfg.rollout.num_actors)]
    return [
        ActorSpec(
            name=f"rollout-{i}",
            cls=RolloutActor,
            handle=RolloutHandle,
            args=(cfg.rollout, cfg.model, cfg.eval),
            kwargs=settings,
            rank=i,
            world_size=cfg.rollout.num_actors,
            slot=slot,
            # as the learner's: only where a restart pays for a new process and the spare holds no GPU
            standby=cfg.rollout.standby and cfg.cluster.use_ray and not slot.gpus and not slot.num_gpus,
            prefer_node=cfg.cluster.prefer_nodes.get("rollout", ""),
        )
        for i, slot in enumerate(slots)
    ]


def warm_start_section(cfg: KilnConfig) -> WarmStartConfig:
    """The warm-start section with its solution directory filled in: by default the task set's
    solutions for the verifier's backend (the learner does not read the replay or verifier sections),
    resolved against the driver's directory as the rest of the config is."""
    solutions = cfg.warm_start.solutions or Path(cfg.replay.tasks) / "solutions" / cfg.verifier.backend
    return dataclasses.replace(cfg.warm_start, solutions=str(Path(solutions).resolve()))
