"""Learner checkpoints on disk: atomic directories, the RNG state, and the run's `latest` marker.

Layout under a run directory:
  checkpoints/step-000123/      one complete checkpoint: the backend's files + meta.json
  checkpoints/latest            the name of the newest complete checkpoint directory
A checkpoint is written into a hidden staging directory and renamed into place only when complete,
and `latest` is replaced (write a temp file, then rename) only after that rename. A crash at any
point therefore leaves `latest` naming a complete checkpoint (or no `latest` at all); leftover
staging directories are swept on the next write. The weight version is the learner actor's business:
it travels in `CheckpointMeta`, beside the backend's state, never inside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class CheckpointMeta:
    """What the actor stores beside the backend's state."""

    version: int  # weight version of the checkpointed weights
    step: int  # learner steps taken
    time: float  # unix seconds when written


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a staging directory beside `path`; when the block finishes, flush it and rename it to
    `path` (which must not exist). If the block raises, the staging directory is removed."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f"{STAGING_PREFIX}{path.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        os.rename(staging, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Every random-number generator a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(rng_state(), f)


def load_rng(path: Path) -> None:
    with open(path, "rb") as f:  # our own file, written by save_rng
        set_rng_state(pickle.load(f))


# ------------------------------------------------------------------------------ run checkpoints


def write_checkpoint(run_dir: Path, backend, meta: CheckpointMeta) -> Path:
    """Save `backend` (a LearnerBackend) and `meta` as checkpoints/step-NNNNNN under `run_dir`, then
    point `latest` at it. Returns the checkpoint directory."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(f"{STAGING_PREFIX}*"):  # from a crash mid-write; never named by `latest`
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / step_dir_name(meta.step)
    if final.exists():  # a re-save of this step after a restore: the new state replaces it
        if _read_marker(root) == final.name:
            raise FileExistsError(f"{final} is the latest checkpoint; refusing to overwrite it")
        shutil.rmtree(final)
    with atomic_directory(final) as staging:
        backend.save_checkpoint(staging / "state")
        (staging / META).write_text(json.dumps(asdict(meta)))
    _write_marker(root, final.name)
    return final


def read_latest(run_dir: Path) -> tuple[Path, CheckpointMeta] | None:
    """(the state directory to hand to `backend.load_checkpoint`, its meta) of the newest complete
    checkpoint, or None when the run has none."""
    root = Path(run_dir) / CHECKPOINTS
    name = _read_marker(root)
    if name is None:
        return None
    ckpt = root / name
    meta = json.loads((ckpt / META).read_text())
    return ckpt / "state", CheckpointMeta(
        version=int(meta["version"]), step=int(meta["step"]), time=float(meta["time"])
    )


def _read_marker(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def _write_marker(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)
