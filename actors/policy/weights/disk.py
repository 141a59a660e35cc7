"""The `disk` transport: each version as an HF checkpoint directory, `<run_dir>/weights/v{version}`
(model.safetensors + config.json), written atomically, the last `keep_disk` kept; engines load the
directory an announcement names.

It works wherever the engines see the learner's file system, and it is the fallback of every other
transport: an engine whose process-group join failed asks for the current version on disk
(`WeightRequest.transport = "disk"`), which is then written if it is not already there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from actors.policy.weights.base import EngineWeights, Load, Loader, Published, Sender, SenderSettings, unique_tensors
from protocols import ErrorReply, Record, WeightAnnouncement, WeightHandles, WeightRequest

log = logging.getLogger(__name__)


def write_hf_dir(root: Path, version: int, named: list[tuple[str, torch.Tensor]], hf_config=None) -> Path:
    """Write `root/v{version}` (model.safetensors + config.json) atomically: a temporary directory
    renamed into place, so an engine never reads a half-written version."""
    from safetensors.torch import save_file

    final = root / f"v{version}"
    if final.exists():
        return final
    tmp = root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous().cpu() for n, t in named}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if hf_config is not None:
        text = hf_config.to_json_string() if hasattr(hf_config, "to_json_string") else json.dumps(hf_config)
        (tmp / "config.json").write_text(text)
    os.replace(tmp, final)
    return final


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` version directories."""
    versions = sorted((int(p.name[1:]), p) for p in root.glob("v*") if p.name[1:].isdigit())
    for _, path in versions[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


class DiskSender(Sender):
    name = "disk"

    def __init__(self, settings: SenderSettings) -> None:
        self.root = Path(settings.run_dir) / "weights"
        self.keep, self.hf_config = settings.keep_disk, settings.hf_config

    def publish(self, current: Published, named: list[tuple[str, torch.Tensor]]) -> str:
        return str(self.write(current.version, named))

    def answer(self, request: WeightRequest, current: Published, reply: Callable[[Record], None]) -> bool:
        try:
            answer = self._announce(current)
        except Exception as err:  # e.g. the disk is full: the engine learns why and retries
            log.exception("weights: writing the current version for %s failed", request.engine_id)
            answer = ErrorReply(message=f"writing version {current.version} failed: {err}")
        reply(answer)
        return False

    def _announce(self, current: Published) -> WeightAnnouncement:
        if current.version < 0:
            return WeightAnnouncement(version=-1, manifest=[], transport=self.name)
        path = self.root / f"v{current.version}"
        if not path.exists():  # a fallback: this learner pushes another way, so the version is not written yet
            path = self.write(current.version, unique_tensors(current.named()))
        return WeightAnnouncement(
            version=current.version, manifest=current.manifest, transport=self.name, location=str(path)
        )

    def write(self, version: int, named: list[tuple[str, torch.Tensor]]) -> Path:
        path = write_hf_dir(self.root, version, named, self.hf_config)
        prune_versions(self.root, self.keep)
        return path


class DiskLoader(Loader):
    name = "disk"

    def join(
        self, engine: EngineWeights, engine_id: str, reply: WeightAnnouncement | WeightHandles, have: int
    ) -> Load | None:
        return self.receive(engine, reply) if reply.version > have else None

    def receive(self, engine: EngineWeights, announcement: WeightAnnouncement) -> Load | None:
        return lambda: engine.update_weights_from_disk(announcement.location, announcement.version)
