"""On-disk cache of built extensions, binding objects and capture results, safe across processes.

Only the trusted build service writes it. No process that runs candidate code sees any of it: a
capture or execution sandbox sees links to the libraries of its own build only, in a directory of
its own (service.py, executor.py); the compilers see `bind/` (to link a cached binding object)
read-only.

Layout under `root` (one per toolchain digest, so toolchains never share an entry):
  ext/<spec key>/{<module>.so, meta.json}   a built extension that passed the symbol check; the
                                            directory appears by one rename
  rejected/<spec key>.json                  what a library that failed the symbol check imports (its
                                            findings): the library itself is never kept
  bind/<binding key>.o                      a compiled binding TU, shared by equal signatures
  captures/<source hash>.json               a whole candidate's BuildResult (ok or compile error)
  tmp/                                      build directories (same filesystem, so renames are atomic)
  jobs/<job>/                               one compile child's scratch; its build dirs go here too,
                                            so removing the job dir after the child removes its litter
  locks/                                    flock files: one builder per key, the others wait;
                                            `<key>.use`, held shared while an entry is in use (`pin`)
Writers build into a temp dir on the same filesystem and publish with os.rename/os.replace;
readers see all or nothing.

The cache is bounded (`trim`): past `max_bytes`, entries of ext/, rejected/ and captures/ go least
recently used first (a hit or a publish is a use: the entry's mtime), and never an extension that is
in use (pinned by a build job or a run, in this process or another). Every read of it is bounded
before it allocates (MAX_RECORD_BYTES).
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

# A meta.json, a rejected library's record or a capture result is at most this (read and written).
MAX_RECORD_BYTES = 16 << 20
DEFAULT_MAX_BYTES = 8 << 30  # the cache's bound (ext/, rejected/, captures/) unless told otherwise


def read_bounded(path: Path, limit: int = MAX_RECORD_BYTES) -> bytes | None:
    """The file's bytes when it holds at most `limit` of them, else None (nothing larger is read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def _json(path: Path) -> dict | None:
    data = read_bounded(path)
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Pins:
    """Extensions held in use (a shared flock on each one's use-lock) until `release()` or until
    this object is gone: `trim` never removes them."""

    def __init__(self, fds: list[int] | None = None) -> None:
        self._fds = list(fds or [])

    def add(self, other: Pins) -> None:
        self._fds += other._fds
        other._fds = []

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)  # closing the descriptor drops its lock
            except OSError:
                pass

    def __del__(self) -> None:
        self.release()


class ArtifactCache:
    def __init__(
        self, cache_dir: Path, toolchain_digest: str, tmp_dir: Path | None = None, *, create: bool = True
    ) -> None:
        """`create=False` (a jailed build process, which sees the cache read-only): create nothing."""
        self.root = Path(cache_dir) / toolchain_digest
        if create:
            for sub in ("ext", "rejected", "bind", "captures", "tmp", "locks", "jobs"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tmp_dir) if tmp_dir else self.root / "tmp"
        self._trim_lock = threading.Lock()

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
        """(path of the .so, its meta) when `key` was built, else None. A hit is a use (LRU)."""
        d = self.root / "ext" / key
        meta = _json(d / "meta.json")
        so = d / str(meta.get("module", "")) if meta is not None else None
        if so is None or so.suffix != ".so" or so.parent != d or not so.is_file():
            return None
        _touch(d / "meta.json")
        return so, meta

    def pin(self, keys) -> Pins:
        """Hold the extensions of `keys` in use (see Pins); a key with no entry is pinned all the same,
        so an entry published later under it is safe too."""
        fds = []
        for key in sorted(set(keys)):
            try:
                fd = os.open(self.root / "locks" / f"{key}.use", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            fds.append(fd)
        return Pins(fds)

    # ------------------------------------------------------------------ rejected libraries
    def reject(self, key: str, record: dict) -> None:
        """Remember what a library that failed the symbol check imports (the library is not kept)."""
        final = self.root / "rejected" / f"{key}.json"
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        data = json.dumps(record)
        if len(data) <= MAX_RECORD_BYTES:
            tmp.write_text(data)
            os.replace(tmp, final)

    def rejected(self, key: str) -> dict | None:
        path = self.root / "rejected" / f"{key}.json"
        record = _json(path)
        if record is not None:
            _touch(path)
        return record

    def publish(self, key: str, build_dir: Path, so_name: str, meta: dict) -> Path:
        """Move `build_dir/so_name` into the cache under `key` atomically; returns the final .so path."""
        stage = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self.tmp))
        os.chmod(stage, 0o755)  # jailed processes (another uid) import it, read-only
        shutil.copyfile(build_dir / so_name, stage / so_name)
        os.chmod(stage / so_name, 0o644)
        (stage / "meta.json").write_text(json.dumps({**meta, "module": so_name})[:MAX_RECORD_BYTES])
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
        path = self.capture_path(source_key)
        data = _json(path)
        if data is not None:
            _touch(path)
        return data

    def store_capture(self, source_key: str, data: dict) -> None:
        """Store a capture's result (one larger than MAX_RECORD_BYTES is not stored: it is captured
        again next time)."""
        text = json.dumps(data)
        if len(text) > MAX_RECORD_BYTES:
            return
        final = self.capture_path(source_key)
        # Unique per writer: two threads of one process may store the same source's capture at once.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, final)

    # ------------------------------------------------------------------ the bound
    def trim(self, max_bytes: int) -> list[str]:
        """Remove least recently used entries (extensions, rejected records, captures) until the cache
        holds at most `max_bytes`; an extension in use (pinned) stays, whatever its age. Returns the
        names of what went."""
        with self._trim_lock:
            entries = self._entries()
            total = sum(size for _, size, _ in entries)
            removed = []
            for _used, size, path in sorted(entries, key=lambda e: e[0]):
                if total <= max_bytes:
                    break
                if self._remove(path):
                    total -= size
                    removed.append(path.name)
            return removed

    def size(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry: each extension's directory, each record file."""
        out = []
        for d in _listdir(self.root / "ext"):
            try:
                used = (d / "meta.json").stat().st_mtime
                out.append((used, sum(f.stat().st_size for f in d.iterdir() if f.is_file()), d))
            except OSError:
                continue
        for sub in ("rejected", "captures"):
            for f in _listdir(self.root / sub):
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.endswith(".json") and not f.name.startswith("."):
                    out.append((st.st_mtime, st.st_size, f))
        return out

    def _remove(self, path: Path) -> bool:
        """Remove one entry; an extension only when no one holds it in use (an exclusive, non-blocking
        flock on its use-lock: a pin anywhere keeps it)."""
        if path.parent.name != "ext":
            try:
                path.unlink()
                return True
            except OSError:
                return False
        try:
            fd = os.open(self.root / "locks" / f"{path.name}.use", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # in use
            gone = self.tmp / f"evicted-{path.name}-{os.getpid()}-{threading.get_ident()}"
            try:
                os.rename(path, gone)  # out of sight at once; then removed
            except OSError:
                return False
            shutil.rmtree(gone, ignore_errors=True)
            return True
        finally:
            os.close(fd)

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


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _listdir(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except OSError:
        return []
