"""Run by tests/launch/driver/test_plan.py in a process of its own (a Ray instance with fake GPUs, apart from
the suite's shared one): build the run's placement group from the plan of each preset named on the
command line, schedule a probe for every planned actor through the `Supervisor` exactly as a run
schedules the actor, and print what Ray did as JSON.

    python tests/launch/driver/placement_probe.py four_gpu.yaml two_gpu.yaml
"""

from __future__ import annotations

import json
import sys
import tempfile

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.loader import PRESETS, load_config
from launch.driver.cluster import reserve_bundles
from launch.driver.handles import ActorHandle
from launch.driver.plan import actor_slot, bundles, plan
from launch.driver.supervisor import ActorSpec, Supervisor


class Probe:
    """Stands in for an actor (same constructor contract: the run context last) and reports its GPUs."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def start(self) -> dict[str, str]:
        return {}

    def stop(self) -> None:
        pass

    def where(self) -> dict:
        return {"gpus": [str(g) for g in ray.get_gpu_ids()], "device_ids": list(self.ctx.slot.device_ids())}


@ray.remote(num_cpus=0, num_gpus=0.01)
def bundle_gpu() -> list[str]:
    """The GPU Ray gives a task scheduled into a bundle: that bundle's GPU."""
    return [str(g) for g in ray.get_gpu_ids()]


def probe(preset: str) -> dict:
    p = plan(load_config(PRESETS / preset), check_fit=False)
    group = reserve_bundles(p)
    table = placement_group_table(group)
    free_gpus = ray.available_resources().get("GPU", 0.0)  # outside the group, once it is reserved
    gpu_of_bundle = [
        ray.get(
            bundle_gpu.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=b.index
                )
            ).remote()
        )
        for b in bundles(p)
    ]
    supervisor = Supervisor(tempfile.mkdtemp(), use_ray=True, placement_group=group)
    actors = {}
    for role, count in (("learner", len(p.learner)), ("rollout", len(p.engines)), ("verifier", len(p.verifiers))):
        for i in range(count):
            slot = actor_slot(p, role, i)
            handle = supervisor.launch(ActorSpec(name=f"{role}-{i}", cls=Probe, handle=ActorHandle, slot=slot))
            actors[handle.name] = {
                "planned_gpus": list(slot.gpus),
                "bundle": slot.bundle,
                "num_gpus": slot.num_gpus,
                **ray.get(handle.ref.where.remote(), timeout=60),
            }
    supervisor.stop_all([])
    remove_placement_group(group)
    return {
        "plan_bundles": [b.resources for b in bundles(p)],
        "plan_bundle_gpus": [list(b.gpus) for b in bundles(p)],
        "group_bundles": [table["bundles"][i] for i in sorted(table["bundles"])],
        "gpu_of_bundle": gpu_of_bundle,
        "free_gpus": free_gpus,
        "actors": actors,
    }


if __name__ == "__main__":
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(json.dumps({preset: probe(preset) for preset in sys.argv[1:]}))
    finally:
        ray.shutdown()
