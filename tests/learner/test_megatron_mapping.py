"""HF <-> megatron weight mapping and TP sharding (actors.learner.megatron.hf_mapping), on CPU."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.learner.megatron import hf_mapping as hm
from tests.learner.megatron_cpu import cpu_stand_ins, two_micro_batches


def tiny_config(arch: str, *, tied: bool, heads: int = 4, kv_heads: int = 2, vocab: int = 259, layers: int = 2):
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        intermediate_size=48,
        tie_word_embeddings=tied,
    )


def random_hf_state(config) -> dict[str, torch.Tensor]:
    """A real transformers model's parameter names and shapes, filled with random values."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return {name: torch.randn_like(p) for name, p in model.state_dict().items() if not name.endswith("inv_freq")}


CASES = [("qwen3", True), ("qwen3", False), ("llama", False), ("qwen2", True)]


@pytest.mark.parametrize("arch,tied", CASES)
def test_hf_megatron_round_trip_is_bit_exact(arch, tied):
    config = tiny_config(arch, tied=tied)
    hf = random_hf_state(config)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=2)
    mg = hm.hf_to_megatron(hf, shape)
    assert list(mg) == hm.megatron_names(shape)
    assert mg["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab_size > config.vocab_size
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mg) == (arch == "qwen3")
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (arch == "qwen2")
    back = hm.megatron_to_hf(mg, shape)
    expected = {n for n in hf if not (tied and n == "lm_head.weight")}
    assert set(back) == expected
    for name in expected:
        assert back[name].dtype == hf[name].dtype
        assert torch.equal(back[name], hf[name]), name


@pytest.mark.parametrize("arch,tied", CASES)
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_then_gather_is_bit_exact(arch, tied, tp):
    config = tiny_config(arch, tied=tied)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=tp)
    hm.check_tp(shape, tp)
    mg = hm.hf_to_megatron(random_hf_state(config), shape)
    for name, full in mg.items():
        shards = hm.shard(name, full, tp)
        assert len(shards) == tp
        kind = hm.parallel_kind(name)
        if kind != "replicated":
            assert all(s.numel() * tp == full.numel() for s in shards), name
        assert torch.equal(hm.gather(name, [s.clone() for s in shards]), full), name


def test_swiglu_shards_pair_gate_and_up_halves():
    config = tiny_config("llama", tied=False)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=2)
    hf = random_hf_state(config)
    fc1 = hm.to_megatron("decoder.layers.1.mlp.linear_fc1.weight", hf, shape)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    for rank, s in enumerate(hm.shard("decoder.layers.1.mlp.linear_fc1.weight", fc1, 2)):
        rows = slice(rank * 24, (rank + 1) * 24)
        local_gate, local_up = torch.chunk(s, 2, dim=0)  # what megatron's glu() does per rank
        assert torch.equal(local_gate, gate[rows]) and torch.equal(local_up, up[rows])


def test_vocab_shards_hold_padding_on_the_last_rank_only():
    config = tiny_config("qwen3", tied=True)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=4)
    emb = hm.to_megatron("embedding.word_embeddings.weight", random_hf_state(config), shape)
    shards = hm.shard("embedding.word_embeddings.weight", emb, 4)
    assert shape.padded_vocab_size == 256 * 2 and all(s.shape[0] == 128 for s in shards)
    assert torch.count_nonzero(torch.cat(shards)[config.vocab_size :]) == 0


def megatron_split_qkv(outputs: list[torch.Tensor], shape: hm.ModelShape, tp: int, rank: int):
    """The q, k, v TP rank `rank` attends with, following SelfAttention.get_query_key_value_tensors;
    outputs[r] is rank r's linear_qkv output [tokens, rows/tp]."""
    hn, ng, nh = shape.head_dim, shape.num_kv_heads, shape.num_heads
    mixed = outputs[rank]
    if ng < tp:  # all-gather the ranks' outputs, keep this rank's group, then its share of q heads
        groups_per_rank, heads_per_rank = 1, nh // ng
        mixed_full = torch.cat(outputs, dim=-1)
        size = mixed_full.shape[-1] // ng
        idx = rank // (tp // ng)
        mixed = mixed_full[:, idx * size : (idx + 1) * size]
    else:
        groups_per_rank, heads_per_rank = ng // tp, nh // tp
    per_group = heads_per_rank // groups_per_rank
    mixed = mixed.reshape(mixed.shape[0], groups_per_rank, (per_group + 2) * hn)
    q, k, v = torch.split(mixed, [per_group * hn, hn, hn], dim=-1)
    q = q.reshape(q.shape[0], -1, hn)
    if ng < tp:
        size = nh // tp
        q = q[:, (rank % (tp // ng)) * size : (rank % (tp // ng) + 1) * size]
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (4, 2, 4), (4, 4, 2), (8, 1, 2)])
def test_fused_qkv_layout_gives_each_rank_its_heads(heads, kv_heads, tp):
    """Numerically: the q/k/v heads megatron computes from the fused, sharded weight are HF's heads
    that the rank owns (GQA: q head h uses kv head h // (heads / kv_heads))."""
    config = tiny_config("qwen2", tied=True, heads=heads, kv_heads=kv_heads)
    hf = random_hf_state(config)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=tp)
    hn = shape.head_dim
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    p = "model.layers.0.self_attn."
    ref = {
        c: (x @ hf[p + f"{c}_proj.weight"].double().T + hf[p + f"{c}_proj.bias"].double()).reshape(5, -1, hn)
        for c in "qkv"
    }
    name = "decoder.layers.0.self_attention.linear_qkv."
    w_shards = hm.shard(name + "weight", hm.to_megatron(name + "weight", hf, shape), tp)
    b_shards = hm.shard(name + "bias", hm.to_megatron(name + "bias", hf, shape), tp)
    outputs = [x @ w.double().T + b.double() for w, b in zip(w_shards, b_shards, strict=True)]
    q_per_rank = heads // tp
    for rank in range(tp):
        q, k, v = megatron_split_qkv(outputs, shape, tp, rank)
        q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
        assert torch.allclose(q, ref["q"][:, list(q_heads)], rtol=0, atol=1e-12)
        kv_heads_of_rank = sorted({h // (heads // kv_heads) for h in q_heads})
        assert k.shape[1] == len(kv_heads_of_rank)
        assert torch.allclose(k, ref["k"][:, kv_heads_of_rank], rtol=0, atol=1e-12)
        assert torch.allclose(v, ref["v"][:, kv_heads_of_rank], rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch,tied", CASES)
@pytest.mark.parametrize("pp", [1, 2])
def test_pipeline_stages_hold_every_parameter_once(arch, tied, pp):
    """The stages' parameters, renamed to whole-model names, are the model's parameters exactly once
    (plus, with a tied embedding and PP > 1, the last stage's copy of the embedding); megatron numbers
    each stage's layers from 0; full_shape is every full tensor's shape."""
    config = tiny_config(arch, tied=tied, layers=4)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=1)
    stages = [hm.stage(shape, pp, r) for r in range(pp)]
    names = [hm.stage_names(shape, s) for s in stages]
    whole = [g for per_stage in names for _, g in per_stage]
    copies = ["output_layer.weight"] if tied and pp > 1 else []
    assert whole == hm.megatron_names(shape) + copies
    assert [hm.is_tied_copy(n, shape) for n in whole].count(True) == len(copies)
    for s, per_stage in zip(stages, names, strict=True):
        layers = sorted({int(local.split(".")[2]) for local, _ in per_stage if local.startswith("decoder.layers.")})
        assert layers == list(range(4 // pp)) and s.layers() == range(s.rank * 4 // pp, (s.rank + 1) * 4 // pp)
        assert ("embedding.word_embeddings.weight" in dict(per_stage)) == (s.rank == 0)
    mg = hm.hf_to_megatron(random_hf_state(config), shape)
    for name, t in mg.items():
        assert hm.full_shape(name, shape) == tuple(t.shape), name
    if tied:  # the copy is built from the embedding
        assert torch.equal(
            hm.to_megatron("output_layer.weight", random_hf_state(config), shape),
            mg["embedding.word_embeddings.weight"],
        )
    with pytest.raises(ValueError, match="does not divide"):
        hm.stage(shape, 3, 0)


def test_buckets_are_bounded_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1, 100])]
    out = list(hm.buckets(tensors, bucket_bytes=80))
    assert [n for b in out for n, _ in b] == [n for n, _ in tensors]
    for b in out:
        assert len(b) == 1 or sum(t.numel() * 4 for _, t in b) <= 80
    assert [[n for n, _ in b] for b in out] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    with pytest.raises(ValueError):
        list(hm.buckets(tensors, 0))


def test_bad_inputs_fail_clearly():
    config = tiny_config("qwen3", tied=True)
    shape = hm.ModelShape.from_hf_config(config, tensor_parallel=1)
    hf = random_hf_state(config)
    with pytest.raises(ValueError, match="no megatron counterpart"):
        hm.hf_to_megatron({**hf, "model.layers.0.extra.weight": torch.zeros(1)}, shape)
    with pytest.raises(KeyError):
        hm.hf_to_megatron({n: t for n, t in hf.items() if "k_norm" not in n}, shape)
    with pytest.raises(ValueError, match="does not divide"):
        hm.check_tp(
            hm.ModelShape(
                num_layers=1,
                hidden_size=48,
                num_heads=6,
                num_kv_heads=3,
                head_dim=8,
                intermediate_size=64,
                vocab_size=256,
                tied_embeddings=True,
                qk_norm=False,
                qkv_bias=False,
                padded_vocab_size=256,
            ),
            4,
        )
    with pytest.raises(ValueError, match="not supported"):
        hm.ModelShape.from_hf_config(AutoConfig.for_model("gpt2"))
    with pytest.raises(ValueError, match="differ"):
        hm.gather("decoder.final_layernorm.weight", [torch.zeros(3), torch.ones(3)])


# ------------------------------------------------------------------ megatron-side pieces that run on CPU


def test_sdpa_attention_keeps_packed_sequences_apart():
    """SDPAAttention on a THD-packed row equals RoPE + causal attention run on each sequence alone,
    positions restarting at 0 (GQA: q head h reads kv head h // group)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from actors.learner.megatron.attention import PackedSequences, RotaryTables, SDPAAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    attn = SDPAAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    torch.manual_seed(0)
    bounds = [0, 5, 5, 12, 13]  # an empty sequence and a one-token sequence ride along
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0])
    q, k, v = torch.randn(13, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
    rope = RotaryTables(10000.0, 8)
    out = attn(q, k, v, None, packed_seq_params=PackedSequences.build(bounds, positions, rope))
    assert out.shape == (13, 32)

    def rotate(x):  # RoPE of one whole sequence starting at position 0, written out per pair
        t = torch.arange(len(x)).float()[:, None] * rope.inv_freq[None, :]  # [t, d/2]
        x1, x2 = x[..., :4], x[..., 4:]
        c, s_ = t.cos()[:, None], t.sin()[:, None]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)

    def reference(qs, ks, vs):  # naive softmax attention, [t, h, d]
        qs, ks = rotate(qs), rotate(ks)
        ks, vs = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / 8**0.5
        causal = torch.ones(len(qs), len(qs), dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, vs).reshape(len(qs), -1)

    for a, b in itertools.pairwise(bounds):
        if b > a:
            assert torch.allclose(out[a:b], reference(q[a:b], k[a:b], v[a:b]), atol=1e-5)
    with pytest.raises(ValueError, match="RoPE tables"):
        attn(q, k, v, None)


def test_micro_batches_split_over_dp_ranks_by_tokens():
    from actors.learner.batch import micro_batches
    from actors.learner.data_parallel import assign_micro_batches

    cu = np.concatenate([[0], np.cumsum([300, 517, 128, 700, 64, 911, 400])])
    micros = micro_batches(cu, 1024)
    for dp in (1, 2, 3):
        parts = [assign_micro_batches(micros, dp, r) for r in range(dp)]
        assert sorted((m for p in parts for m in p), key=lambda m: m.start) == micros  # each exactly once
        loads = [sum(m.stop - m.start for m in p) for p in parts]
        assert max(loads) - min(loads) <= max(m.stop - m.start for m in micros)
        assert all(p == sorted(p, key=lambda m: m.start) for p in parts)


def test_backend_refuses_what_it_cannot_train():
    """An unsupported dtype fails with a one-line ConfigError before any GPU or process group is touched."""
    from actors.learner.megatron.backend import MegatronBackend
    from configs import ConfigError, LearnerConfig, ModelConfig

    with pytest.raises(ConfigError, match="float16"):
        MegatronBackend(
            ModelConfig(dtype="float16"), LearnerConfig(backend="megatron", pipeline_parallel=2), reference=True
        )


# ------------------------------------------------------------------ the real GPTModel on CPU, TP and PP over gloo
#
# megatron-core's local GPTModel (with Kiln's SDPAAttention doing RoPE) runs on CPU, and so does
# `MegatronBackend.forward_backward` on megatron-core's own schedules (no pipelining, and 1F1B with its
# point-to-point sends over gloo), once the few places where they name the GPU are sent to the CPU:
# the schedules' token counter (`torch.zeros(device="cuda")`), the p2p buffers
# (`device=torch.cuda.current_device()`), the p2p `torch.cuda.synchronize()`, and the tied
# embedding's `weight.data.cuda()` before its first all-reduce across stages. Each worker is a
# separate process (this file run as a script), so the gloo group and those redirections never touch
# the pytest process. The cases of one world size run one after another in the same workers (one per
# rank), each under model-parallel groups of its own: a worker's start-up (torch, transformers,
# megatron-core) costs several times its cases' work.

PARITY_CASES = [  # (arch, tied, tp, pp)
    ("qwen3", True, 1, 1),
    ("qwen3", True, 2, 1),
    ("qwen2", True, 2, 1),
    ("llama", False, 2, 1),
    ("qwen3", True, 1, 2),
    ("llama", False, 1, 2),
    ("qwen2", True, 2, 2),
    ("qwen3", True, 4, 1),
]


def _parity_worker(rank: int, world: int, port: int, cases: list[tuple[str, bool, int, int]]) -> None:
    import json
    import os
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    for arch, tied, tp, pp in cases:
        result = _parity_case(rank, tp, pp, arch, tied)
        print(json.dumps({"case": [arch, tied, tp, pp], **result}), flush=True)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    os._exit(0)


def _parity_case(rank: int, tp: int, pp: int, arch: str, tied: bool) -> dict:
    """One case on this rank, under model-parallel groups of TP = tp and PP = pp: what it measured."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from actors.learner.losses import token_entropy
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.model import (
        Kernels,
        build_gpt,
        hf_tensors,
        load_hf_weights,
        local_parameters,
        rotary_tables,
    )
    from actors.learner.megatron.parallel import Layout
    from actors.policy.model import build_model
    from configs import ModelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    cfg = ModelConfig(
        arch=arch,
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        seed=parallel_state.get_data_parallel_rank(),
    )  # one model per DP replica
    hf = build_model(cfg, "cpu")
    if not tied:
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight) * 0.05)
    shape = hm.ModelShape.from_hf_config(hf.config, tp)
    stage = hm.stage(shape, pp, pp_rank)
    with cpu_stand_ins():
        gpt = build_gpt(
            hf.config, shape, tensor_parallel=tp, dtype="float32", max_seq_len=128, stage=stage, on_cpu=True
        )
    load_hf_weights(gpt, hf.state_dict(), shape)
    tokens, packed, micros = two_micro_batches()
    # The backend's model code without its GPU set-up (megatron's distributed optimizer needs CUDA; its
    # DDP is tested on CPU in test_megatron_overlap.py): forward_backward needs only the model, the
    # shape, the layout, the RoPE tables and whether the DDP overlaps its gradient reduction (no DDP here).
    backend = object.__new__(MegatronBackend)
    backend.model = backend.gpt = gpt
    backend.overlap_grad_reduce, backend._backward_ran = False, False
    backend.reference, backend.shape, backend.stage, backend.device = None, shape, stage, torch.device("cpu")
    backend.layout = Layout(tp=tp, dp=1, tp_rank=tp_rank, dp_rank=0, rank=rank, pp=pp, pp_rank=pp_rank)
    backend.rope = rotary_tables(hf.config, shape)
    weights = torch.linspace(-1, 1, len(tokens))  # a loss that weighs tokens differently, as the policy loss does

    def loss_fn(mb, out):
        return (out.logprobs * weights[mb.positions]).sum(), (out.logprobs.detach(), out.entropy())

    # The plain fp32 path first, then the chunked one (rows in chunks of 16: the 25- and 15-row
    # micro-batches take several all-reduce rounds), whose gradients are checked below.
    with cpu_stand_ins():
        backend.kernels = Kernels(fused_logprobs=False, compile=False)
        plain = backend.forward_backward(packed, micros, loss_fn, temperature=0.7)
        gpt.zero_grad(set_to_none=True)
        backend.kernels = Kernels(fused_logprobs=True, logprob_chunk_rows=16, compile=False)
        reports = backend.forward_backward(packed, micros, loss_fn, temperature=0.7)
    ours = torch.cat([lp for lp, _ in reports])
    entropy = torch.cat([h for _, h in reports])
    chunked_vs_plain = float((ours - torch.cat([lp for lp, _ in plain])).abs().max())
    ref_logits = torch.cat([hf(input_ids=tokens[None, :25]).logits[0], hf(input_ids=tokens[None, 25:]).logits[0]])
    ref = torch.log_softmax(ref_logits / 0.7, -1).gather(1, packed.targets[:, None])[:, 0]
    ref_entropy = token_entropy(ref_logits, 0.7)
    (ref * weights).sum().backward()
    # Backward: every rank's gradient is its shard of HF's gradient, except q/k norms, whose per-rank
    # gradients cover only that rank's heads and add up over TP, and a tied embedding, whose two copies
    # (first and last stage) add up over the embedding group (megatron's finalize_model_grads).
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    if tied:
        hf_grads["lm_head.weight"] = hf_grads["model.embed_tokens.weight"]
    grad_err = 0.0
    for name, param in local_parameters(gpt, shape).items():
        expected = hm.shard(name, hm.to_megatron(name, hf_grads, shape), tp)[tp_rank]
        got = param.grad.clone()
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(got, group=parallel_state.get_tensor_model_parallel_group())
        if tied and pp > 1 and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            dist.all_reduce(got, group=parallel_state.get_embedding_group())
        grad_err = max(grad_err, float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
    with torch.no_grad():
        exported = dict(hf_tensors(gpt, shape))
    state = hf.state_dict()
    exact = all(torch.equal(t, state[n]) for n, t in exported.items()) and len(exported) == len(state) - tied
    tp_tags = all(
        bool(getattr(p, "tensor_model_parallel", False)) == (hm.parallel_kind(n) != "replicated")
        for n, p in local_parameters(gpt, shape).items()
    )  # megatron's grad norm counts untagged weights once
    return {
        "rank": rank,
        "max_diff": float((ours - ref).abs().max()),
        "round_trip_exact": exact,
        "entropy_diff": float((entropy - ref_entropy).abs().max()),
        "grad_rel_err": grad_err,
        "tp_tags": tp_tags,
        "chunked_vs_plain": chunked_vs_plain,
        "stage": pp_rank,
    }


@functools.cache
def parity_results(world: int) -> dict[tuple, list[dict]]:
    """Every parity case of `world` ranks, run in one set of workers: case -> each rank's result."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    cases = [c for c in PARITY_CASES if c[2] * c[3] == world]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    args = [str(world), str(port), *(f"{arch},{int(tied)},{tp},{pp}" for arch, tied, tp, pp in cases)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), *args],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**__import__("os").environ, "PYTHONPATH": str(root)},
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=240 * len(cases)) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results: dict[tuple, list[dict]] = {case: [] for case in cases}
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith('{"case": '):
                record = json.loads(line)
                results[tuple(record.pop("case"))].append(record)
    return results


@pytest.mark.parametrize("arch,tied,tp,pp", PARITY_CASES)
def test_megatron_gpt_matches_hf_under_tp_and_pp(arch, tied, tp, pp):
    """The real megatron-core GPTModel (local spec + SDPAAttention, packed sequences, vocab-parallel
    logprobs and entropies with padded vocabulary), split over TP ranks and PP stages and built from HF
    weights, run through MegatronBackend.forward_backward on megatron-core's schedule (two
    micro-batches; 1F1B with p2p over gloo when PP = 2; with TP = 4 the last rank's vocabulary slice is
    all padding), gives HF's logprobs and entropies on every
    rank (the last stage's reports reach the others), the chunked logprobs equal the plain fp32 ones,
    and every rank holds its shard of HF's gradients; gathering the TP shards of every stage gives back
    HF's tensors bit-exactly on every rank."""
    results = parity_results(tp * pp)[(arch, tied, tp, pp)]
    assert len(results) == tp * pp, results  # one report from every rank
    assert sorted(r["stage"] for r in results) == sorted(s for s in range(pp) for _ in range(tp))
    for result in results:
        assert result["round_trip_exact"], result
        assert result["max_diff"] < 1e-4 and result["entropy_diff"] < 1e-4, result
        assert result["chunked_vs_plain"] < 1e-5, result
        assert result["grad_rel_err"] < 1e-4, result
        assert result["tp_tags"], result


if __name__ == "__main__":
    import sys

    rank, world, port, *specs = sys.argv[1:]
    cases = [(arch, bool(int(tied)), int(tp), int(pp)) for arch, tied, tp, pp in (c.split(",") for c in specs)]
    _parity_worker(int(rank), int(world), int(port), cases)
