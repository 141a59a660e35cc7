"""On-disk verdict cache: the same source, task and toolchain under the same verdict-shaping settings
gets the same VerifyResult without running again.

Key = sha256(source hash, task id, reference hash, toolchain id, the verifier settings that change a
verdict or a score, VERIFIER_VERSION). Results whose outcome depends on the moment (infra, timeout)
are never stored. Entries are `protocols.encode`d VerifyResults written by atomic rename; an entry
that does not decode is treated as a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from configs import VerifierConfig
from protocols import ProtocolError, Task, VerifyResult, decode, encode

# Bump whenever the verifier's checks change what a candidate's verdict would be.
VERIFIER_VERSION = "kiln-verifier-1"
UNCACHED = ("infra", "timeout")


def verdict_settings(cfg: VerifierConfig) -> dict:
    return {
        "backend": cfg.backend, "trials": cfg.trials, "atol": cfg.atol, "rtol": cfg.rtol,
        "warmup": cfg.warmup, "repeats": cfg.repeats, "compile_baseline": cfg.compile_baseline,
        "reward": dataclasses.asdict(cfg.reward), "legality": dataclasses.asdict(cfg.legality),
    }


def verdict_key(source_hash: str, task: Task, toolchain: str, cfg: VerifierConfig) -> str:
    reference = task.kernel.reference if task.kernel is not None else json.dumps(task.payload, sort_keys=True)
    blob = json.dumps({"source": source_hash, "task": task.task_id,
                       "reference": hashlib.sha256(reference.encode()).hexdigest(), "toolchain": toolchain,
                       "settings": verdict_settings(cfg), "version": VERIFIER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class VerdictCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def get(self, key: str) -> VerifyResult | None:
        try:
            data = self._path(key).read_bytes()
            result = decode(data)
        except (OSError, ProtocolError):
            return None
        if not isinstance(result, VerifyResult):
            return None
        self.hits += 1
        return result

    def put(self, key: str, result: VerifyResult) -> None:
        if result.error_class in UNCACHED:
            return
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(encode(result))
        os.replace(tmp, path)
