"""Config loading: every shipped preset loads, mistakes name the key, every field is documented."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from configs import ConfigError, KilnConfig, load_config, to_yaml
from configs.loader import PRESETS, RENAMED, all_keys, final_names
from launch.cli.config_doc import render_markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset", sorted(PRESETS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, KilnConfig)
    assert load_config(preset, []) == cfg  # deterministic


def test_overrides_apply_after_the_preset():
    cfg = load_config(None, ["algo.group_size=8", "verifier.reward.lam=0.25", "rollout.sglang.urls=[http://a:1]"])
    assert cfg.algo.group_size == 8 and cfg.verifier.reward.lam == 0.25
    assert cfg.rollout.sglang.urls == ["http://a:1"]
    assert load_config().algo.group_size != 8


def test_mirrorpop_filters_switch_off_with_null():
    cfg = load_config(None, ["algo.mirrorpop_delta=null", "algo.mirrorpop_token_delta=null"])
    assert (cfg.algo.mirrorpop_delta, cfg.algo.mirrorpop_token_delta) == (None, None)
    assert load_config().algo.mirrorpop_token_delta == 2.0  # the token bound is on by default


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.grup_size=8", "unknown config key 'algo.grup_size'; nearest valid keys: algo.group_size"),
        ("algoo.group_size=8", "unknown config key 'algoo'; nearest valid keys: algo"),
        ("verifier.reward.lamda=1", "nearest valid keys: verifier.reward.lam"),
        ("algo.group_size=1", r"algo.group_size=1 is out of range: must be >= 2"),
        ("algo.alpha=1.5", r"algo.alpha=1.5 is out of range: must be <= 1.0"),
        ("replay.retry.probability=-0.1", "replay.retry.probability=-0.1 is out of range"),
        ("verifier.backend=rocm", r"verifier.backend='rocm' is not one of \['cuda', 'cpu'\]"),
        ("algo.group_size=many", "config key 'algo.group_size'"),
        ("algo=3", "'algo' must be a mapping"),
        ("group_size", "not of the form section.key=value"),
        ("model.num_kv_heads=3", "must divide model.num_heads"),
        ("cluster.prefer_nodes.rollouts=a=b", "cluster.prefer_nodes.rollouts='a=b': a role"),
        ("cluster.prefer_nodes.rollout=cpu", "maps to a node label 'key=value'"),
        ("learner.pipeline_parallel=0", r"learner.pipeline_parallel=0 is out of range: must be >= 1"),
        (
            "learner.megatron.logprob_chunk_rows=0",
            r"learner.megatron.logprob_chunk_rows=0 is out of range: must be >= 1",
        ),
        ("model.path=null model.vocab_size=100", "the byte tokenizer needs at least 259"),
        ("eval.k=8", "eval.k=8 exceeds eval.samples=4"),
        ("algo.mirrorpop_token_delta=0", r"algo.mirrorpop_token_delta=0.0 is out of range: must be > 0.0"),
    ],
)
def test_mistakes_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_bad_preset_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"bad.yaml: unknown config key 'learner.lrr'; nearest valid keys: learner.lr"
    ):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    # PyYAML keeps the last of two equal keys silently: the first line, the one a reader sees, did nothing
    bad.write_text("algo:\n  group_size: 4\n  batch_groups: 2\n  group_size: 8\n")
    with pytest.raises(ConfigError, match=r"key 'group_size' appears twice in one mapping \(lines 2 and 4\)"):
        load_config(bad)
    bad.write_text("algo:\n  group_size: 4\nrollout:\n  group_size: 4\n")  # the same name in two sections
    with pytest.raises(ConfigError, match="unknown config key 'rollout.group_size'"):
        load_config(bad)


def _fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], f"{prefix}{f.name}.")


def test_every_field_has_a_comment():
    undocumented = [k for k, f in _fields(KilnConfig) if len(f.metadata.get("help", "")) < 10]
    assert not undocumented, f"config fields without help text: {undocumented}"
    sections = {k for k in all_keys() if "." not in k}
    assert sections == {
        "cluster",
        "model",
        "rollout",
        "verifier",
        "replay",
        "learner",
        "algo",
        "warm_start",
        "eval",
        "logging",
        "serve",
    }


@pytest.mark.parametrize("preset", sorted(p.name for p in PRESETS.glob("*.yaml")))
def test_presets_use_all_cores_for_compiles_or_say_why_not(preset):
    """verifier.compile_workers is 0 (the node's cores ÷ its verifier actors), or its line says why not."""
    lines = [ln for ln in (PRESETS / preset).read_text().splitlines() if ln.strip().startswith("compile_workers:")]
    for line in lines:
        value, _, why = line.split(":", 1)[1].partition("#")
        assert int(value) == 0 or len(why.strip()) > 10, f"{preset}: {line.strip()} needs a reason beside it"


def test_configuration_reference_is_current():
    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == render_markdown(), "regenerate: kiln config --markdown > docs/configuration.md"


def test_cli_prints_resolved_config_and_rejects_bad_keys():
    kiln = [sys.executable, "-m", "launch.cli"]
    ok = subprocess.run(kiln + ["config", "algo.group_size=5"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert ok.returncode == 0 and "group_size: 5" in ok.stdout
    assert load_config(None, ["algo.group_size=5"]) == load_config(None, ["algo.group_size=5"])
    bad = subprocess.run(kiln + ["config", "algo.nope=1"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("kiln: config error: command line: unknown config key 'algo.nope'")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "override", ["learner.backend=megatron model.dtype=float16", "learner.backend=megatron algo.kl_coef=0.1"]
)
def test_what_the_megatron_backend_refuses_is_refused_at_load(override):
    with pytest.raises(ConfigError, match="the megatron backend"):
        load_config(None, override.split())


OLD_FLAT_YAML = """\
rollout:
  engine: sglang
  sglang_urls: [http://router:30000]
learner:
  weight_sync: nccl
"""


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_an_old_key_on_the_command_line_names_its_new_name(old, new):
    with pytest.raises(ConfigError, match=f"^command line: {re.escape(old)} was renamed to {re.escape(new)}$"):
        load_config(None, [f"{old}=1"])


def test_an_old_flat_key_yaml_gets_one_line_and_a_non_zero_exit(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(OLD_FLAT_YAML)
    with pytest.raises(ConfigError, match="rollout.sglang_urls was renamed to rollout.sglang.urls"):
        load_config(old)
    old.write_text("learner:\n  weight_sync: nccl\n")  # a value where a section now is
    with pytest.raises(ConfigError, match="learner.weight_sync was renamed to learner.weight_sync.transport"):
        load_config(old)
    for cmd in (["config", "--config", str(old)], ["train", "--dry-run", "--config", str(old)]):
        out = subprocess.run(
            [sys.executable, "-m", "launch.cli", *cmd], capture_output=True, text=True, cwd=ROOT, check=False
        )
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (
            f"kiln: config error: {old}: learner.weight_sync was renamed to learner.weight_sync.transport\n"
        )


def test_a_key_renamed_twice_names_its_name_now():
    assert final_names({"a": "b", "b": "c", "x": "y"}) == {"a": "c", "b": "c", "x": "y"}
    with pytest.raises(ValueError, match="circle"):
        final_names({"a": "b", "b": "a"})
    # rollout.concurrent_groups became rollout.max_inflight, which became rollout.max_attempts_at_engine
    with pytest.raises(
        ConfigError, match="^command line: rollout.concurrent_groups was renamed to rollout.max_attempts_at_engine$"
    ):
        load_config(None, ["rollout.concurrent_groups=4"])


def test_in_flight_budgets_and_eta_carry_their_unit_and_section_in_their_names(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("verifier:\n  max_inflight: 4\n")
    with pytest.raises(ConfigError, match="verifier.max_inflight was renamed to verifier.max_concurrent_requests$"):
        load_config(old)
    old.write_text("replay:\n  max_staleness: 0\n")
    with pytest.raises(ConfigError, match="replay.max_staleness was renamed to algo.max_staleness$"):
        load_config(old)
    cfg = load_config(None, ["algo.max_staleness=0", "rollout.max_attempts_at_engine=6"])
    assert (cfg.algo.max_staleness, cfg.rollout.max_attempts_at_engine) == (0, 6)


def test_performance_turns_are_on_by_default_until_a_speedup(tmp_path):
    cfg = load_config(None)
    assert cfg.rollout.optimize_turns == 1 and cfg.rollout.optimize_until is None  # null = eval.fast_threshold
    assert load_config(None, ["rollout.optimize_until=1.5"]).rollout.optimize_until == 1.5
    with pytest.raises(ConfigError, match="rollout.optimize_until"):
        load_config(None, ["rollout.optimize_until=0"])
    old = tmp_path / "old.yaml"
    old.write_text("rollout:\n  optimize_turns: 1\n  optimize_below: 0.5\n")
    with pytest.raises(
        ConfigError, match=f"^{re.escape(str(old))}: rollout.optimize_below was renamed to rollout.optimize_until$"
    ):
        load_config(old)


def test_every_renamed_key_points_at_a_key_that_exists():
    keys = set(all_keys())
    assert all(new in keys for new in RENAMED.values())
    assert not any(old in keys and not old.endswith("weight_sync") for old in RENAMED)


def test_yaml_dump_reloads_to_the_same_config(tmp_path):
    cfg = load_config(None, ["algo.total_steps=17", "model.path=/models/x"])
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert load_config(out) == cfg
