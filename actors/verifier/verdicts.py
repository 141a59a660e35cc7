"""On-disk verdict cache: the same source, task and toolchain under the same verdict-shaping settings
gets the same VerifyResult without running again, and nothing but the verifier can write an entry.

Key = sha256(source hash, task id, reference hash, toolchain id, the verifier settings that change a
verdict or a score, VERIFIER_VERSION and a digest of the verifier's own code, so that a changed
verifier never serves a verdict its predecessor reached). Results whose outcome depends on the moment (infra, timeout)
are never stored. The cache lives in the verifier's cache directory, which no sandbox can see
(isolation.kiln_hidden), and each entry is authenticated anyway: an HMAC-SHA256, keyed by a secret
that only the verifier's processes can read (`<root>/.key`, mode 0600, created on first use), over
the entry's claims (key, source hash, task id) and the encoded result. A hit is used only when the
HMAC checks and the claims match the request's own source hash and task; a forged, altered or
transplanted entry is a miss. Entries are written by atomic rename.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time
from pathlib import Path

from configs import VerifierConfig
from protocols import ProtocolError, Task, VerifyResult, decode, encode

# The verifier's generation, for people; the key also holds `code_digest()`, which changes by itself.
VERIFIER_VERSION = "kiln-verifier-sealed-1"
UNCACHED = ("infra", "timeout")
_MAGIC = b"kiln-verdict-1\n"
# An entry is at most this (verdicts are bounded on the way out: redact.py); a larger file is a miss,
# read no further than this.
MAX_ENTRY_BYTES = 2 << 20


def verdict_settings(cfg: VerifierConfig) -> dict:
    return {
        "backend": cfg.backend,
        "trials": cfg.trials,
        "atol": cfg.atol,
        "rtol": cfg.rtol,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "compile_baseline": cfg.compile_baseline,
        "reward": dataclasses.asdict(cfg.reward),
        "legality": dataclasses.asdict(cfg.legality),
    }


def verifier_sources() -> list[Path]:
    """Every source file of the verifier's package (Python, C and C++), its subpackages included: a
    module added or moved is in the digest without being named anywhere."""
    root = Path(__file__).resolve().parent
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".cpp") and p.is_file())


@functools.cache
def code_digest() -> str:
    """sha256 over the verifier's own sources (Python, C and C++): any edit is a new verifier."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in verifier_sources():
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def verdict_key(source_hash: str, task: Task, toolchain: str, cfg: VerifierConfig) -> str:
    reference = task.kernel.reference if task.kernel is not None else json.dumps(task.payload, sort_keys=True)
    blob = json.dumps(
        {
            "source": source_hash,
            "task": task.task_id,
            "reference": hashlib.sha256(reference.encode()).hexdigest(),
            "toolchain": toolchain,
            "settings": verdict_settings(cfg),
            "version": VERIFIER_VERSION,
            "code": code_digest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class VerdictCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._key = _secret(self.root / ".key")
        self.hits = 0
        self.rejected = 0  # entries present but not authentic (or not about this source): misses

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def _mac(self, claims: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, claims + b"\0" + body, hashlib.sha256).digest()

    def get(self, key: str, source_hash: str, task_id: str) -> VerifyResult | None:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read(MAX_ENTRY_BYTES + 1)
        except OSError:
            return None
        result = self._open(data, key, source_hash, task_id) if len(data) <= MAX_ENTRY_BYTES else None
        if result is None:
            self.rejected += 1
            return None
        self.hits += 1
        return result

    def _open(self, data: bytes, key: str, source_hash: str, task_id: str) -> VerifyResult | None:
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 36:
            return None
        rest = data[len(_MAGIC) :]
        mac, rest = rest[:32], rest[32:]
        n = int.from_bytes(rest[:4], "big")
        claims, body = rest[4 : 4 + n], rest[4 + n :]
        if not hmac.compare_digest(mac, self._mac(claims, body)):
            return None
        try:
            said = json.loads(claims)
            result = decode(body)
        except (ValueError, ProtocolError):
            return None
        if said != {"key": key, "source_hash": source_hash, "task_id": task_id}:
            return None
        if not isinstance(result, VerifyResult) or result.source_hash != source_hash or result.task_id != task_id:
            return None
        return result

    def put(self, key: str, result: VerifyResult) -> None:
        if result.error_class in UNCACHED:
            return
        claims = json.dumps(
            {"key": key, "source_hash": result.source_hash, "task_id": result.task_id}, sort_keys=True
        ).encode()
        body = encode(result)
        data = _MAGIC + self._mac(claims, body) + len(claims).to_bytes(4, "big") + claims + body
        if len(data) > MAX_ENTRY_BYTES:
            return
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def _secret(path: Path) -> bytes:
    """The cache's HMAC key: read it, or create it (mode 0600, exclusive create, so two verifiers
    starting at once agree on one key)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another verifier created it a moment ago and is writing it
            key = path.read_bytes()
            if len(key) >= 32:
                return key
            time.sleep(0.02)
        raise RuntimeError(f"verdict cache key {path} is damaged (remove the cache directory)") from None
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key
