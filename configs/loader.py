"""Load a Kiln config: schema defaults <- YAML preset <- dotlist overrides, then check every bound.

Any mistake stops start-up with a `ConfigError` that names the key: unknown keys come with the
nearest valid keys, out-of-range values with the bound and the field's help, and a key of an earlier
layout (`RENAMED`) with its name now.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.rollout import FORCED_VARIANTS
from configs.schema import KilnConfig

PRESETS = Path(__file__).resolve().parent
DEFAULT_PRESET = PRESETS / "default.yaml"


class ConfigError(ValueError):
    """A config could not be loaded; the message names the offending key."""


# Every rename, old key -> the key it was renamed to then (history: a key renamed twice appears twice).
# A YAML file or override that uses an old key is refused with "X was renamed to Y", Y being the key's
# name now (`RENAMED`); a silent alias would leave two spellings of one setting in circulation.
RENAMES = {
    "rollout.concurrent_groups": "rollout.max_inflight",  # a budget of attempts in flight, not of groups
    "rollout.max_inflight": "rollout.max_attempts_in_flight",  # its unit in its name (verifiers count requests)
    "rollout.max_attempts_in_flight": "rollout.max_attempts_at_engine",  # attempts being verified no longer count
    "verifier.max_inflight": "verifier.max_concurrent_requests",  # requests one verifier works on at once
    "replay.max_staleness": "algo.max_staleness",  # η: read by replay and learner alike, from the section both get
    "rollout.sglang_urls": "rollout.sglang.urls",
    "rollout.sglang_launch_module": "rollout.sglang.launch_module",
    "rollout.sglang_tp_size": "rollout.sglang.tp_size",
    "rollout.sglang_mem_fraction": "rollout.sglang.mem_fraction",
    "rollout.sglang_base_port": "rollout.sglang.base_port",
    "rollout.sglang_start_timeout_s": "rollout.sglang.start_timeout_s",
    "rollout.sglang_extra_args": "rollout.sglang.extra_args",
    "rollout.verify_timeout_s": "rollout.verify_reply_timeout_s",
    "verifier.verify_timeout_s": "verifier.reward_timeout_s",
    "learner.weight_sync": "learner.weight_sync.transport",
    "learner.bucket_mb": "learner.weight_sync.bucket_mb",
    "algo.sft_warmup_steps": "warm_start.steps",
    "algo.sft_solutions": "warm_start.solutions",
    "algo.sft_lr": "warm_start.lr",
    "algo.sft_batch_tokens": "warm_start.batch_tokens",
    "algo.eval_samples": "eval.samples",
    "logging.eval_every": "eval.every",
    "logging.eval_k": "eval.k",
    # now the speedup vs eager a pass must reach (1 / the old time factor); null = eval.fast_threshold
    "rollout.optimize_below": "rollout.optimize_until",
}


def final_names(renames: dict[str, str]) -> dict[str, str]:
    """Each old key -> its name now, following chains of renames (a -> b, b -> c gives a -> c)."""
    final = {}
    for old, renamed in renames.items():
        seen, new = {old}, renamed
        while new in renames:
            if new in seen:
                raise ValueError(f"the renames of {old} run in a circle through {new}")
            seen.add(new)
            new = renames[new]
        final[old] = new
    return final


RENAMED = final_names(RENAMES)


def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = (), *, preset_without: Iterable[str] = ()
) -> KilnConfig:
    """Resolve a config. `path` None means configs/default.yaml; overrides are `a.b=c` strings.
    `preset_without`: top-level sections of the preset left at the schema's defaults (the command
    line's overrides still apply to them)."""
    preset = _read_yaml(Path(path) if path is not None else DEFAULT_PRESET)
    for section in preset_without:
        preset.pop(section, None)
    dotlist = _parse_overrides(list(overrides))
    for source, tree in ((str(path or DEFAULT_PRESET), preset), ("command line", dotlist)):
        _check_keys(tree, KilnConfig, "", source)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(KilnConfig), preset, dotlist)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from None
    _check_bounds(cfg, "")
    _check_consistency(cfg)
    return cfg


def to_yaml(cfg: KilnConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def all_keys(cls: type = KilnConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included."""
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        sub = _dataclass_type(cls, f)
        if sub is not None:
            keys.extend(all_keys(sub, key + "."))
    return keys


# ------------------------------------------------------------------------------------- helpers


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the
    last silently, so the first line, the one a reader may be looking at, would do nothing."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a text file (byte {err.start} is not UTF-8); a config is a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it: {err.strerror}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader
    except yaml.YAMLError as err:
        problem = " ".join(str(err).split())
        raise ConfigError(f"{path}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(items: list[str]) -> dict:
    tree: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {part!r}")
        node[leaf] = value
    return tree


def _dataclass_type(cls: type, f: dataclasses.Field):
    tp = typing.get_type_hints(cls)[f.name]
    return tp if dataclasses.is_dataclass(tp) else None


def _check_keys(tree: Any, cls: type, prefix: str, source: str) -> None:
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        sub = _dataclass_type(cls, fields[key]) if key in fields else None
        # A renamed key: gone, or now a section where the old layout had a value (learner.weight_sync).
        if dotted in RENAMED and (key not in fields or (sub is not None and not isinstance(value, dict))):
            raise ConfigError(f"{source}: {dotted} was renamed to {RENAMED[dotted]}")
        if key not in fields:
            raise ConfigError(f"{source}: unknown config key '{dotted}'{_nearest(str(dotted))}")
        if sub is not None:
            _check_keys(value, sub, dotted + ".", source)


def _nearest(key: str) -> str:
    candidates = all_keys()
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    if not close and section:
        close = [k for k in candidates if k.startswith(section) and k.count(".") == key.count(".")][:6]
    if not close:
        close = [f.name for f in dataclasses.fields(KilnConfig)]
    return "; nearest valid keys: " + ", ".join(close)


def _check_bounds(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        key, value, meta = f"{prefix}{f.name}", getattr(obj, f.name), f.metadata
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key + ".")
            continue
        if value is None:
            continue
        choices = meta.get("choices")
        dotted = meta.get("dotted_ok") and isinstance(value, str) and "." in value
        if choices is not None and value not in choices and not dotted:
            extra = " or a dotted import path" if meta.get("dotted_ok") else ""
            raise ConfigError(f"{key}={value!r} is not one of {choices}{extra} ({meta['help']})")
        for op, bound, ok in (
            (">=", meta.get("ge"), lambda v, b: v >= b),
            (">", meta.get("gt"), lambda v, b: v > b),
            ("<=", meta.get("le"), lambda v, b: v <= b),
            ("<", meta.get("lt"), lambda v, b: v < b),
        ):
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{key}={value!r} is out of range: must be {op} {bound} ({meta['help']})")


def _check_consistency(cfg: KilnConfig) -> None:
    """Rules that span several fields."""
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} must divide model.hidden_size={m.hidden_size}")
    if m.tokenizer == "bytes" and not m.path and m.vocab_size < 259:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size}: the byte tokenizer needs at least 259 (256 bytes + 3 specials)"
        )
    if cfg.verifier.reward_actor_args and not cfg.verifier.reward_actor:
        raise ConfigError(
            "verifier.reward_actor_args are the constructor arguments of a plug-in reward actor; "
            "set verifier.reward_actor, or leave them empty for the kernel verifier"
        )
    for role, label in cfg.cluster.prefer_nodes.items():
        key, _, value = str(label).partition("=")
        if role not in ("replay", "verifier", "learner", "rollout") or not key or not value:
            raise ConfigError(
                f"cluster.prefer_nodes.{role}={label!r}: a role (replay, verifier, learner, rollout) maps to "
                "a node label 'key=value', as given to `ray start --labels`"
            )
    if cfg.replay.task_source_args and not cfg.replay.task_source:
        raise ConfigError(
            "replay.task_source_args are the constructor arguments of a plug-in task source; "
            "set replay.task_source, or leave them empty for replay.tasks"
        )
    mix = cfg.rollout.forced_mix
    unknown = sorted(set(mix) - set(FORCED_VARIANTS))
    if unknown:
        raise ConfigError(
            f"rollout.forced_mix: unknown variant(s) {', '.join(unknown)}; the variants are "
            f"{', '.join(FORCED_VARIANTS)}"
        )
    if any(w < 0 for w in mix.values()) or not any(w > 0 for w in mix.values()):
        raise ConfigError(
            f"rollout.forced_mix: weights must be >= 0 and one at least > 0, got "
            f"{', '.join(f'{k}={w:g}' for k, w in mix.items())}"
        )
    if cfg.algo.early_bonus_turn2 > cfg.algo.early_bonus_turn1:
        raise ConfigError("algo.early_bonus_turn2 must not exceed algo.early_bonus_turn1 (an earlier pass earns more)")
    if cfg.eval.k > cfg.eval.samples:
        raise ConfigError(
            f"eval.k={cfg.eval.k} exceeds eval.samples={cfg.eval.samples}: pass@k needs k samples per task"
        )
    bench = cfg.rollout.bench
    if any(n < 1 for n in bench.lengths):
        raise ConfigError(f"rollout.bench.lengths={list(bench.lengths)}: every length must be >= 1")
    if bench.length_weights and (
        len(bench.length_weights) != len(bench.lengths)
        or any(w < 0 for w in bench.length_weights)
        or sum(bench.length_weights) <= 0
    ):
        raise ConfigError(
            f"rollout.bench.length_weights={list(bench.length_weights)}: one weight >= 0 per entry "
            f"of rollout.bench.lengths ({len(bench.lengths)}), not all zero"
        )
    if cfg.learner.backend == "megatron":  # what the megatron backend refuses at start-up
        if m.dtype == "float16":
            raise ConfigError("model.dtype=float16: the megatron backend trains in bfloat16 or float32")
        if cfg.algo.kl_coef > 0:
            raise ConfigError(
                f"algo.kl_coef={cfg.algo.kl_coef}: the megatron backend has no reference-model "
                "pass; use 0 or learner.backend=torch"
            )


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or ""
    msg = str(err).splitlines()[0]
    return f"config key '{key}': {msg}" if key else f"config error: {msg}"
