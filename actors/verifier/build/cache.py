"""On-disk cache of built extensions, binding objects and capture results, safe across processes.

Only the trusted build service writes it; jailed processes see `ext/` (to import a built extension)
and `bind/` (to link a cached binding object) read-only, and the rest not at all.

Layout under `root` (one per toolchain digest, so toolchains never share an entry):
  ext/<spec key>/{<module>.so, meta.json}   a built extension; the directory appears by one rename
  bind/<binding key>.o                      a compiled binding TU, shared by equal signatures
  captures/<source hash>.json               a whole candidate's BuildResult (ok or compile error)
  tmp/                                      build directories (same filesystem, so renames are atomic)
  jobs/<job>/                               one compile child's scratch; its build dirs go here too,
                                            so removing the job dir after the child removes its litter
  locks/                                    flock files: one builder per key, the others wait
Writers build into a temp dir on the same filesystem and publish with os.rename/os.replace;
readers see all or nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path


class ArtifactCache:
    def __init__(
        self, cache_dir: Path, toolchain_digest: str, tmp_dir: Path | None = None, *, create: bool = True
    ) -> None:
        """`create=False` (a jailed build process, which sees the cache read-only): create nothing."""
        self.root = Path(cache_dir) / toolchain_digest
        if create:
            for sub in ("ext", "bind", "captures", "tmp", "locks", "jobs"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tmp_dir) if tmp_dir else self.root / "tmp"

    def remove_stale(self, older_than_s: float) -> None:
        """Remove job and build dirs left by processes that died (older than any live job)."""
        cutoff = time.time() - older_than_s
        for sub in ("jobs", "tmp"):
            for d in (self.root / sub).iterdir():
                try:
                    if d.stat().st_mtime < cutoff:
                        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink()
                except OSError:
                    continue

    # ------------------------------------------------------------------ extensions
    def lookup(self, key: str) -> tuple[Path, dict] | None:
        """(path of the .so, its meta) when `key` was built, else None."""
        d = self.root / "ext" / key
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        so = d / str(meta.get("module", "")) if isinstance(meta, dict) else None
        if so is None or so.suffix != ".so" or not so.is_file():
            return None
        return so, meta

    def publish(self, key: str, build_dir: Path, so_name: str, meta: dict) -> Path:
        """Move `build_dir/so_name` into the cache under `key` atomically; returns the final .so path."""
        stage = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self.tmp))
        os.chmod(stage, 0o755)  # jailed processes (another uid) import it, read-only
        shutil.copyfile(build_dir / so_name, stage / so_name)
        os.chmod(stage / so_name, 0o644)
        (stage / "meta.json").write_text(json.dumps({**meta, "module": so_name}))
        final = self.root / "ext" / key
        try:
            os.rename(stage, final)
        except OSError:  # another process published the same key first: theirs is as good
            shutil.rmtree(stage, ignore_errors=True)
        return final / so_name

    # ------------------------------------------------------------------ binding objects
    def binding_object(self, key: str) -> Path:
        return self.root / "bind" / f"{key}.o"

    def publish_binding(self, key: str, obj: Path) -> Path:
        final = self.binding_object(key)
        # Unique per writer: two threads of one process may store the same source's capture at once.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        shutil.copyfile(obj, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
        return final

    # ------------------------------------------------------------------ capture results
    def capture_path(self, source_key: str) -> Path:
        return self.root / "captures" / f"{source_key}.json"

    def load_capture(self, source_key: str) -> dict | None:
        try:
            data = json.loads(self.capture_path(source_key).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def store_capture(self, source_key: str, data: dict) -> None:
        final = self.capture_path(source_key)
        # Unique per writer: two threads of one process may store the same source's capture at once.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, final)

    # ------------------------------------------------------------------ scratch and locks
    def build_dir(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp))

    @contextlib.contextmanager
    def lock(self, name: str):
        """Exclusive, cross-process lock named `name` (held until the block ends or the process dies)."""
        with open(self.root / "locks" / f"{name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
