"""The verifiers of an evaluation, and the one seam through which attempts are verified.

`VerifierSet` starts `verifier.num_actors` of Kiln's own `VerifierActor`s (the training verifier:
anti-cheat gate, legality, timing under the exclusive device lease, all unchanged), in this process
or as Ray actors like training's, registered in the evaluation directory's registry. `verify_batch`
sends a batch of attempts to every registered verifier through the rollout actors' verify client,
which marks an attempt `infra` when no verifier answers it in time.

`RemoteVerifierSet` stands in for it when a verifier service verifies instead (`verifier.remote`,
`kiln serve`): the same attempts, the same verdicts, over HTTP, and no verifier of its own starts.

`verify_batch` is the only place an evaluation touches verification: when the rollout pipeline's
verifier pool lands, it replaces this function's body and nothing else changes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from actors.base import Slot
from actors.rollout.episodes import Verifier
from configs import RolloutConfig, VerifierConfig
from protocols import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)


class VerifierSet:
    def __init__(
        self, cfg: VerifierConfig, rollout: RolloutConfig, run_dir: Path, *, use_ray: bool, gpu_share: float = 1.0
    ) -> None:
        """`gpu_share`: the share of each GPU the verifiers take together under Ray (the rest is the
        engine's when it runs on Ray too)."""
        from actors.verifier.actor import VerifierActor
        from launch.driver.handles import VerifierHandle
        from launch.driver.supervisor import ActorSpec, Supervisor

        self.cfg, self.use_ray = cfg, use_ray
        self.supervisor = Supervisor(run_dir, use_ray=use_ray)
        self.supervisor.registry.clear()  # addresses of an interrupted evaluation's verifiers are stale
        gpus = _visible_gpus() if use_ray and cfg.backend == "cuda" else 0
        for i in range(cfg.num_actors):
            # Under Ray a cuda verifier needs a GPU share to see a device; actors spread over the GPUs.
            slot = Slot(gpus=(i % gpus,), num_gpus=min(1.0, gpu_share * gpus / cfg.num_actors)) if gpus else Slot()
            self.supervisor.launch(
                ActorSpec(
                    name=f"verifier-{i}",
                    cls=VerifierActor,
                    handle=VerifierHandle,
                    args=(cfg,),
                    rank=i,
                    world_size=cfg.num_actors,
                    slot=slot,
                )
            )
        # Each verifier works on verifier.max_concurrent_requests requests at once; keep them all busy.
        self.client = Verifier(
            self.supervisor.registry.pool_resolver("verifier", "verifier"),
            timeout_s=rollout.verify_reply_timeout_s,
            retries=rollout.verify_retries,
            concurrency=max(1, cfg.num_actors * cfg.max_concurrent_requests),
        )

    @property
    def sent(self) -> int:
        """Attempts sent for verification so far."""
        return self.client.stats["sent"]

    def close(self) -> None:
        self.client.close()
        self.supervisor.stop_all(["verifier-"])


class RemoteVerifierSet:
    """The evaluation's attempts verified by a verifier service (`verifier.remote`), through the rollout
    actors' own front to it (actors/rollout/remote_verifier.py): each resent `rollout.verify_retries`
    times, then `infra`; at most `parallel` at once."""

    def __init__(self, cfg: VerifierConfig, rollout: RolloutConfig, parallel: int = 16) -> None:
        self.url, self.rollout, self.parallel = cfg.remote, rollout, parallel
        self.stats: dict[str, int] = {}
        self.client = self  # verify_batch's seam: `client.verify_all`

    @property
    def sent(self) -> int:
        return self.stats.get("sent", 0)

    def verify_all(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        import asyncio

        from actors.rollout.remote_verifier import RemoteVerifier

        async def run() -> list[VerifyResult]:
            front = RemoteVerifier(
                self.url,
                timeout_s=self.rollout.verify_reply_timeout_s,
                retries=self.rollout.verify_retries,
                stats=self.stats,
            )
            gate = asyncio.Semaphore(self.parallel)

            async def one(request: VerifyRequest) -> VerifyResult:
                async with gate:
                    return await front.verify(request)

            try:
                return list(await asyncio.gather(*(one(r) for r in requests)))
            finally:
                await front.close()

        return asyncio.run(run())

    def close(self) -> None:
        pass


def verify_batch(verifiers: VerifierSet | RemoteVerifierSet, requests: list[VerifyRequest]) -> list[VerifyResult]:
    """Verdicts for `requests`, in order, from the set's verifiers."""
    return verifiers.client.verify_all(requests)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()
