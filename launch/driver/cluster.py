"""The run's Ray cluster, for the length of one session: started here (or joined, `cluster.address`),
with one placement group whose bundles are the placement plan's GPU slots, and given back in the
reverse order when the session ends. A run with `cluster.use_ray=false` has none of this: its actors
run in the driver's process.
"""

from __future__ import annotations

import os
import sys
from typing import Self

from configs import ClusterConfig
from launch.driver import stop_signal
from launch.driver.plan import PlacementPlan, bundles

PLACEMENT_TIMEOUT_S = 300.0


class RayCluster:
    """`with RayCluster(cfg.cluster, placement) as cluster:` Ray is up and `cluster.placement_group`
    holds every GPU bundle of the plan (None when the plan has no GPU)."""

    def __init__(self, c: ClusterConfig, placement: PlacementPlan) -> None:
        self.c, self.placement = c, placement
        self.placement_group = None
        self._started = False  # Ray was started by this session (a joined or running Ray is left up)

    def __enter__(self) -> Self:
        self._started = start_ray(self.c)
        self.placement_group = reserve_bundles(self.placement)
        return self

    def __exit__(self, *exc) -> None:
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started:
            import ray

            ray.shutdown()


def start_ray(c: ClusterConfig) -> bool:
    """Start Ray (or join `cluster.address`) unless it runs in this process already; True when it was
    started here. The actors' log lines come to this process's stderr with Ray's prefix, coloured only
    where stderr is a terminal: in a log file the colour codes are noise (RAY_COLOR_PREFIX set by the
    user wins)."""
    import ray

    if ray.is_initialized():
        return False
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        with stop_signal.ray_start():  # ray.init replaces the CLI's SIGTERM handler (a stack dump instead)
            if c.address:
                ray.init(address=c.address, log_to_driver=True)
            else:
                ray.init(num_cpus=c.num_cpus, num_gpus=c.num_gpus, include_dashboard=False, log_to_driver=True)
    except KeyboardInterrupt:
        ray.shutdown()  # a driver left half-connected crashes the interpreter's exit (SIGSEGV)
        raise
    return True


def reserve_bundles(placement: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """The run's Ray placement group: one bundle per GPU slot of the plan (None when the plan has no
    GPU). Waits until Ray has reserved every bundle; a cluster that cannot hold them fails here."""
    gpu_bundles = bundles(placement)
    if not gpu_bundles:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([b.resources for b in gpu_bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - whatever stopped the reservation, the group goes and the run stops
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve the plan's {len(gpu_bundles)} GPU bundles within {timeout_s:g} s "
            f"({sum(len(b.gpus) for b in gpu_bundles)} GPUs): is the cluster smaller than "
            "cluster.num_gpus?"
        ) from None
    return group
