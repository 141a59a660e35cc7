"""The placement plan (launch/driver/plan.py), the GPU presets, and the cluster scripts' argument checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors.base import Slot
from configs import load_config
from configs.loader import PRESETS
from launch.driver.model_memory import model_shape
from launch.driver.plan import PlanError, actor_slot, bundles, local_gpus, plan, render

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "launch" / "cluster"

# Each preset and the GPUs it is written for (default.yaml: CPU only).
INTENDED_GPUS = {
    "default.yaml": 0,
    "bench_cpu.yaml": 0,
    "single_gpu.yaml": 1,
    "bench_gpu.yaml": 1,
    "two_gpu.yaml": 2,
    "four_gpu.yaml": 4,
    "eight_gpu.yaml": 8,
    "musacoder_27b.yaml": 24,
}


def _plan(preset: str, *overrides: str, gpus=None, memory=None):
    return plan(load_config(PRESETS / preset, overrides), gpus_available=gpus, gpu_memory_gb=memory)


def _shares_fit(p) -> bool:
    """Ray's fractional GPU shares on every GPU add up to at most one."""
    used: dict[int, float] = {}
    for r in p.learner:
        if r.gpu is not None:
            used[r.gpu] = used.get(r.gpu, 0) + r.gpu_fraction
    for e in p.engines:
        for g in e.gpus:
            used[g] = used.get(g, 0) + e.gpu_fraction
    for v in p.verifiers:
        for g in v.gpus:
            used[g] = used.get(g, 0) + v.gpu_fraction
    return all(total <= 1.0 + 1e-9 for total in used.values())


def test_every_preset_has_an_intended_gpu_count():
    presets = {p.name for p in PRESETS.glob("*.yaml")}
    assert presets == set(INTENDED_GPUS), (
        f"presets {sorted(presets ^ set(INTENDED_GPUS))}: name each preset's GPU count in INTENDED_GPUS so it is planned"
    )


@pytest.mark.parametrize("preset, gpus", sorted(INTENDED_GPUS.items()))
def test_presets_plan_for_their_gpu_count_and_memory(preset, gpus):
    cfg = load_config(PRESETS / preset)
    p = plan(cfg, gpus_available=gpus)  # GPU memory: the preset's cluster.gpu_memory_gb
    assert p.gpus_needed == gpus
    assert _shares_fit(p)
    if gpus:
        assert cfg.cluster.gpu_memory_gb is not None and p.gpu_memory_gb == cfg.cluster.gpu_memory_gb
        assert all(load.need_gib <= p.gpu_memory_gb for load in p.gpus)
    if gpus:  # one GPU fewer does not do
        with pytest.raises(PlanError, match=f"needs {gpus} GPUs"):
            _plan(preset, gpus=gpus - 1)


def test_cpu_default_needs_no_gpu():
    p = _plan("default.yaml", gpus=0)
    assert p.layout == "cpu" and p.gpus == ()
    assert [r.gpu for r in p.learner] == [None]
    assert [e.gpus for e in p.engines] == [()] and [v.gpus for v in p.verifiers] == [()]


def test_layouts_put_each_role_where_the_preset_says():
    single = _plan("single_gpu.yaml")
    assert single.layout == "colocated" and single.gpus_needed == 1
    assert single.gpus[0].residents == ("learner rank 0", "engine 0", "verifier 0")
    assert single.learner[0].gpu_fraction == pytest.approx(1 / 3)
    assert "max(learner" in single.gpus[0].how  # the engine releases its memory around learner steps

    two = _plan("two_gpu.yaml")
    assert two.engines[0].gpus == (0,) and two.learner[0].gpu == 1
    assert two.verifiers[0].gpus == (0,) and two.verifiers[0].shared

    four = _plan("four_gpu.yaml")
    assert [(r.rank, r.tp, r.dp, r.gpu) for r in four.learner] == [(0, 0, 0, 1), (1, 1, 0, 2)]
    assert [(v.gpus, v.shared, v.gpu_fraction) for v in four.verifiers] == [((3,), False, 0.5), ((3,), False, 0.5)]

    eight = _plan("eight_gpu.yaml")
    assert [e.gpus for e in eight.engines] == [(0,), (1,), (2,)]
    assert [(r.tp, r.dp, r.gpu) for r in eight.learner] == [(0, 0, 3), (1, 0, 4), (0, 1, 5), (1, 1, 6)]
    assert {v.gpus for v in eight.verifiers} == {(7,)}
    assert eight.model.params >= 1e9

    big = _plan("musacoder_27b.yaml")
    assert 26e9 < big.model.params < 28e9
    assert [(r.tp, r.dp, r.pp) for r in big.learner[7:9]] == [(7, 0, 0), (0, 0, 1)]  # TP fastest, (DP = 1), then PP
    assert all(e.external_url and not e.gpus for e in big.engines)


def test_megatron_memory_follows_the_stated_formula():
    p = _plan("four_gpu.yaml", gpus=4)
    shard = p.model.params / 2  # TP=2, PP=1, DP=1
    parts = p.memory.learner_parts
    assert parts["weights"] == pytest.approx(shard * 2 / 2**30)
    assert parts["grads"] == pytest.approx(shard * 4 / 2**30)  # fp32 grad buffers
    assert parts["optimizer"] == pytest.approx(shard * 12 / 2**30)
    dp2 = _plan("four_gpu.yaml", "cluster.learner_gpus=4", "cluster.num_gpus=6").memory.learner_parts
    assert dp2["optimizer"] == pytest.approx(parts["optimizer"] / 2)  # the distributed optimizer's share
    assert dp2["weights"] == pytest.approx(parts["weights"])


@pytest.mark.parametrize("arch, tied", [("qwen3", True), ("qwen2", False), ("llama", False)])
def test_parameter_count_matches_transformers(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    from actors.policy.model import hf_config

    cfg = load_config(
        None,
        [
            f"model.arch={arch}",
            "model.hidden_size=64",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.num_layers=2",
            "model.intermediate_size=96",
        ],
    )
    hf = hf_config(cfg.model)
    hf.tie_word_embeddings = tied
    if tied:  # random init from the model section, as the engines build it
        shape = model_shape(cfg.model)
    else:  # a checkpoint directory: the plan reads its config.json
        hf.save_pretrained(tmp_path)
        cfg.model.path = str(tmp_path)
        shape = model_shape(cfg.model)
        assert shape.source.endswith("config.json") and not shape.tied_embeddings
    model = AutoModelForCausalLM.from_config(hf)
    assert shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "preset, overrides, gpus, memory, message",
    [
        (
            "four_gpu.yaml",
            [],
            3,
            None,
            r"needs 4 GPUs \(learner 2 \+ engines 1×1 \+ verifiers 1 dedicated\) but 3 are available",
        ),
        (
            "four_gpu.yaml",
            ["learner.tensor_parallel=3", "cluster.learner_gpus=3"],
            None,
            None,
            "learner.tensor_parallel=3 must divide the model's num_heads=16",
        ),
        (
            "four_gpu.yaml",
            ["learner.tensor_parallel=4", "cluster.learner_gpus=4", "model.num_kv_heads=2"],
            None,
            None,
            "learner.tensor_parallel=4 must divide the model's num_kv_heads=2",
        ),
        (
            "four_gpu.yaml",
            ["cluster.learner_gpus=3"],
            None,
            None,
            r"cluster.learner_gpus=3 is not divisible by learner.tensor_parallel × pipeline_parallel = 2×1 = 2",
        ),
        (
            "eight_gpu.yaml",
            [],
            8,
            40.0,
            (
                r"GPU 0 \(engine 0\) needs ~46.1 GiB = engine 46.1 \[weights 2.1, kv_cache 44.0 GiB\] "
                r"but has 40.0 GiB"
            ),
        ),
        (
            "musacoder_27b.yaml",
            ["learner.tensor_parallel=4", "learner.pipeline_parallel=1", "cluster.learner_gpus=4"],
            16,
            80.0,
            r"GPU 0 \(learner rank 0\) needs ~\d+\.\d GiB = learner .*optimizer",
        ),
        ("default.yaml", ["learner.backend=megatron"], None, None, "learner.backend=megatron needs GPUs"),
        ("default.yaml", ["learner.tensor_parallel=2"], None, None, "need learner.backend=megatron"),
        ("default.yaml", ["learner.cpu_ranks=2", "cluster.use_ray=false"], None, None, "needs cluster.use_ray=true"),
        (
            "single_gpu.yaml",
            ["cluster.learner_gpus=2", "cluster.num_gpus=2"],
            None,
            None,
            "colocated runs one learner rank",
        ),
        ("four_gpu.yaml", ["learner.cpu_ranks=2"], None, None, "one rank per GPU"),
        ("default.yaml", ["cluster.engine_gpus=2"], None, None, "the embedded torch engine runs on one device"),
        ("default.yaml", ["rollout.engine=sglang"], None, None, "SGLang servers, which need GPUs"),
        (
            "default.yaml",
            ["rollout.engine=sglang", "cluster.engine_gpus=1", "rollout.sglang.tp_size=2"],
            None,
            None,
            "must equal rollout.sglang.tp_size=2",
        ),
        ("default.yaml", ["cluster.verifier_gpus=1"], None, None, "verifier.backend=cpu needs no GPUs"),
        ("default.yaml", ["verifier.backend=cuda"], None, None, "verifier.backend=cuda runs candidates on a GPU"),
        (
            "single_gpu.yaml",
            ["rollout.num_actors=2"],
            None,
            None,
            r"2 engines × 1 GPUs = 2 do not fit on the learner's 1",
        ),
        (
            "default.yaml",
            ["cluster.layout=colocated", "cluster.engine_gpus=1"],
            None,
            None,
            "colocated puts engines on the learner's GPUs, but cluster.learner_gpus=0",
        ),
        ("four_gpu.yaml", ["cluster.verifier_gpus=3"], None, None, "exceeds verifier.num_actors=2"),
    ],
)
def test_infeasible_plans_say_why(preset, overrides, gpus, memory, message):
    with pytest.raises(PlanError, match=message):
        _plan(preset, *overrides, gpus=gpus, memory=memory)


def test_the_plan_checks_pipeline_parallel_against_the_layers():
    cfg = load_config(PRESETS / "four_gpu.yaml", ["cluster.learner_gpus=10", "learner.pipeline_parallel=5"])
    with pytest.raises(PlanError, match="learner.pipeline_parallel=5 must divide the model's num_layers=22"):
        plan(cfg)


def test_megatron_memory_of_a_pipeline_is_its_most_loaded_stage():
    """PP = 2 halves the layers' parameters per GPU but not the first stage's activations (1F1B keeps
    two micro-batches in flight there); the logits live on the last stage, and the fused kernels
    shrink activations and logits."""
    one = _plan("four_gpu.yaml", "learner.tensor_parallel=1", "cluster.learner_gpus=2", "cluster.num_gpus=4")
    two = _plan(
        "four_gpu.yaml",
        "learner.tensor_parallel=1",
        "learner.pipeline_parallel=2",
        "cluster.learner_gpus=2",
        "cluster.num_gpus=4",
    )
    assert [(r.pp, r.dp) for r in two.learner] == [(0, 0), (1, 0)]
    p1, p2 = one.memory.learner_parts, two.memory.learner_parts
    assert p2["weights"] < 0.75 * p1["weights"]
    m = two.model
    per_layer = (m.params - m.vocab * m.hidden - m.hidden) / m.layers
    first = m.layers / 2 * per_layer + m.vocab * m.hidden
    last = m.layers / 2 * per_layer + m.hidden + m.vocab * m.hidden  # the tied embedding's copy
    stage = first if p2["logits"] == 0 else last
    assert p2["weights"] == pytest.approx(stage * 2 / 2**30)
    if p2["logits"] == 0:  # the first stage: both micro-batches' activations of half the layers
        assert p2["activations"] == pytest.approx(p1["activations"])
    else:
        assert p2["activations"] == pytest.approx(p1["activations"] / 2) and p2["logits"] == p1["logits"]
    plain = _plan(
        "four_gpu.yaml", "learner.megatron.fused_logprobs=false", "learner.megatron.fused_swiglu=false", gpus=4
    ).memory.learner_parts
    fused = _plan("four_gpu.yaml", gpus=4).memory.learner_parts
    assert plain["activations"] > fused["activations"] and plain["logits"] > 3 * fused["logits"]


def test_unreadable_checkpoint_config_is_a_plan_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(PlanError, match="cannot read the model sizes"):
        _plan("default.yaml", f"model.path={tmp_path}")


def test_render_shows_the_table_and_the_numbers():
    text = render(_plan("eight_gpu.yaml", gpus=8))
    assert text.startswith("placement plan: layout disaggregated, 8 GPUs needed of 8 (79 GiB each)")
    assert "1.108B parameters" in text
    for expected in (
        "  3    learner rank 0",
        "verifier 0, verifier 1, verifier 2, verifier 3",
        "learner (megatron):",
        "gpu 7   0.25       dedicated",
        "engine   weights 2.06 + kv_cache 44.00 = 46.06",
    ):
        assert expected in text, expected
    external = render(_plan("musacoder_27b.yaml"))
    assert "http://router:30000" in external and "of 24" in external


def test_the_plan_sizes_each_verifiers_workers():
    two = _plan("two_gpu.yaml", "verifier.compile_workers=3")
    v = two.verifiers[0]
    assert v.compile_workers.count == 3 and v.run_workers.gpus == (0,) * v.run_workers.count >= (0,)
    text = render(two)
    assert "compile workers  run workers  run worker: device" in text
    assert "dedicated" not in text and "0: gpu 0" in text
    assert "run workers 0 = " in text and "a worker over 1 GPU(s)" in text  # sized by this host's cores
    pinned = render(_plan("four_gpu.yaml", "verifier.run_workers=2"))
    assert "0: gpu 3, 1: gpu 3" in pinned
    cpu = _plan("default.yaml", "verifier.compile_workers=0", gpus=0)
    assert cpu.verifiers[0].run_workers.gpus == (None,)
    assert "cores here ÷ 1 verifier actor(s)" in render(cpu) and "0: cpu" in render(cpu)


# ------------------------------------------------------------------------------ Ray placement groups


def test_bundles_follow_the_gpu_slots_of_the_plan():
    four = _plan("four_gpu.yaml")
    assert [b.gpus for b in bundles(four)] == [(0,), (1,), (2,), (3,)]
    assert [actor_slot(four, "learner", r).bundle for r in range(2)] == [1, 2]
    assert actor_slot(four, "rollout", 0).bundle == 0
    assert {actor_slot(four, "verifier", i) for i in range(2)} == {Slot(gpus=(3,), num_gpus=0.5, bundle=3)}
    # a tensor-parallel SGLang engine is one bundle of its GPUs; the verifier sharing its GPUs joins it
    sglang = _plan(
        "default.yaml",
        "rollout.engine=sglang",
        "cluster.engine_gpus=2",
        "rollout.sglang.tp_size=2",
        "rollout.num_actors=2",
        "cluster.learner_gpus=1",
        "verifier.backend=cuda",
    )
    assert [b.gpus for b in bundles(sglang)] == [(0, 1), (2, 3), (4,)]
    assert actor_slot(sglang, "rollout", 1) == Slot(gpus=(2, 3), num_gpus=2.0, bundle=1)
    assert actor_slot(sglang, "verifier", 0) == Slot(gpus=(0,), num_gpus=0.5, bundle=0)
    assert actor_slot(sglang, "rollout", 0) == Slot(gpus=(0, 1), num_gpus=1.0, bundle=0)
    assert actor_slot(sglang, "learner", 0).bundle == 2
    single = _plan("single_gpu.yaml")
    assert [b.gpus for b in bundles(single)] == [(0,)] and actor_slot(single, "learner", 0).colocated
    assert bundles(_plan("default.yaml")) == () and actor_slot(_plan("default.yaml"), "learner", 0) == Slot()
    external = _plan("musacoder_27b.yaml")  # the SGLang servers run outside Kiln: no bundle, no GPU share
    assert len(bundles(external)) == 24 and actor_slot(external, "rollout", 0) == Slot()


def test_the_placement_group_on_a_four_gpu_ray_is_the_plan():
    """A Ray instance with 4 fake GPUs (`ray.init(num_cpus=8, num_gpus=4)`, in a process of its own):
    the run's placement group has one bundle per GPU slot of the plan, and every actor scheduled the
    way a run schedules it lands on its planned GPU (a shared GPU is one device for all its residents)."""
    presets = ["four_gpu.yaml", "two_gpu.yaml"]
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("placement_probe.py")), *presets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for preset in presets:
        p, got = _plan(preset), seen[preset]
        assert got["group_bundles"] == got["plan_bundles"] == [b.resources for b in bundles(p)]
        assert got["plan_bundle_gpus"] == [list(b.gpus) for b in bundles(p)]
        assert got["free_gpus"] == 4 - p.gpus_needed  # the group holds exactly the plan's GPUs
        device_of_bundle = [ids[0] for ids in got["gpu_of_bundle"]]
        assert len(set(device_of_bundle)) == len(device_of_bundle)  # one device per bundle
        planned = (
            {f"learner-{r.rank}": r.gpu for r in p.learner}
            | {f"rollout-{e.index}": e.gpus[0] for e in p.engines}
            | {f"verifier-{v.index}": v.gpus[0] for v in p.verifiers}
        )
        assert set(got["actors"]) == set(planned)
        for name, actor in got["actors"].items():
            assert actor["planned_gpus"] == [planned[name]]
            # on its bundle's device, which it also hands to a process it launches (an SGLang server)
            assert actor["gpus"] == actor["device_ids"] == [device_of_bundle[actor["bundle"]]], name
        by_gpu: dict[int, set[str]] = {}
        for name, actor in got["actors"].items():
            by_gpu.setdefault(planned[name], set()).add(actor["gpus"][0])
        assert all(len(devices) == 1 for devices in by_gpu.values())  # residents of a GPU share one device
        assert len({d for devices in by_gpu.values() for d in devices}) == p.gpus_needed


# ------------------------------------------------------------------------------------ cluster scripts


def _script(name, *args):
    return subprocess.run(
        [str(CLUSTER / name), *args], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )


def test_cluster_scripts_check_their_arguments_before_touching_ray():
    usage = _script("submit.sh")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    missing = _script("submit.sh", "configs/nope.yaml")
    assert missing.returncode == 2 and "config file not found" in missing.stderr
    bad_key = _script("submit.sh", "configs/default.yaml", "algo.grup_size=2")
    assert bad_key.returncode == 2 and "unknown config key 'algo.grup_size'" in bad_key.stderr
    worker = _script("start_worker.sh")
    assert worker.returncode == 2 and "usage:" in worker.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_cluster_scripts_are_shellcheck_clean():
    scripts = sorted(str(p) for p in CLUSTER.glob("*.sh"))
    result = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=CLUSTER, check=False)
    assert result.returncode == 0, result.stdout


@pytest.mark.gpu
def test_the_single_gpu_preset_fits_this_gpu():
    count, memory = local_gpus()
    assert count >= 1 and memory is not None and memory > 10
    p = plan(load_config(PRESETS / "single_gpu.yaml"), gpus_available=count, gpu_memory_gb=memory)
    assert p.gpus[0].need_gib < memory


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("single_gpu.yaml", []),
        (
            "four_gpu.yaml",
            [
                "learner.backend=torch",
                "learner.tensor_parallel=1",
                "cluster.learner_gpus=1",
                "model.hidden_size=1536",
                "model.num_layers=24",
                "model.intermediate_size=4608",
            ],
        ),
    ],
)
def test_torch_learner_memory_matches_the_estimate(preset, overrides):
    """One AdamW step of the HF model at learner.micro_batch_tokens: the peak stays within 15% of
    the plan's learner estimate (the torch activation constant was measured this way)."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.policy.model import hf_config

    cfg = load_config(PRESETS / preset, overrides)
    estimate = plan(cfg).memory.learner_gib
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = (
        AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.bfloat16, attn_implementation="sdpa")
        .cuda()
        .train()
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 256, (cfg.learner.micro_batch_tokens // 4096, 4096), device="cuda")
    for _ in range(2):  # AdamW's moments exist from the second step on
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{preset}: measured peak {peak:.2f} GiB, plan estimate {estimate:.2f} GiB")
    del model, optimizer
    torch.cuda.empty_cache()
    assert abs(peak - estimate) <= 0.15 * peak


def test_the_27b_preset_passes_a_dry_run_with_a_pipeline():
    """`kiln train --config configs/musacoder_27b.yaml --dry-run`: the dense qwen3 stand-in on TP=8 × PP=2,
    the first stage's estimate within an 80 GB GPU."""
    root = PRESETS.parent
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", "--dry-run", "--config", "configs/musacoder_27b.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "27.2" in out.stdout and "learner (megatron):" in out.stdout
    p = _plan("musacoder_27b.yaml")
    assert {(r.pp, r.tp) for r in p.learner} == {(pp, tp) for pp in (0, 1) for tp in range(8)}
    assert p.memory.learner_gib < 79
