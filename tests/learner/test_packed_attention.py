"""The learner's packed attention (actors/policy/packed_attention.py): rows of whole sequences attend
within each sequence without a T x T mask, with the same logits and gradients as transformers' sdpa
and its block mask; calls it does not lay out go to sdpa unchanged."""

from __future__ import annotations

import pytest
import torch

from actors.policy import packed_attention
from actors.policy.model import build_model
from configs import ModelConfig

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=259)


def twins():
    """The same weights under "sdpa" and under the packed attention, in training mode."""
    sdpa = build_model(TINY, "cpu", attention="sdpa").float().train()
    packed = build_model(TINY, "cpu", attention=packed_attention.register()).float().train()
    packed.load_state_dict(sdpa.state_dict())
    return sdpa, packed


def rows_of(lengths_per_row: list[list[int]], seed: int = 0):
    """Token ids and position ids [B, T] of rows packing sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    width = sum(lengths_per_row[0])
    assert all(sum(lengths) == width for lengths in lengths_per_row)
    ids = torch.randint(0, TINY.vocab_size, (len(lengths_per_row), width), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])
    return ids, pos


def test_packed_rows_give_sdpas_logits_and_gradients():
    sdpa, packed = twins()
    ids, pos = rows_of([[7, 1, 30, 12], [25, 25]])  # a one-token sequence, rows of different packings
    outs = []
    for model in (sdpa, packed):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        (logits.float() ** 2).mean().backward()
        outs.append(logits)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(sdpa.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_each_sequence_of_a_row_reads_as_if_alone():
    _, packed = twins()
    lengths = [9, 4, 17]
    ids, pos = rows_of([lengths])
    with torch.no_grad():
        together = packed(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        start = 0
        for n in lengths:
            alone = packed(input_ids=ids[:, start : start + n], use_cache=False).logits[0]
            torch.testing.assert_close(together[start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_no_t_by_t_mask_is_built_for_packed_rows(monkeypatch):
    """The T x T block mask is what made a learner step cost T²: for rows of whole sequences neither
    the mask builder nor the block mask runs."""
    _, packed = twins()

    def refuse(*args, **kwargs):
        raise AssertionError("a T x T mask was built")

    monkeypatch.setattr("transformers.masking_utils.sdpa_mask", refuse)
    monkeypatch.setattr(packed_attention.Packing, "block_mask", refuse)
    ids, pos = rows_of([[40, 60, 28]])
    with torch.no_grad():
        assert packed(input_ids=ids, position_ids=pos, use_cache=False).logits.shape == (1, 128, TINY.vocab_size)


def test_a_padded_batch_and_a_cache_go_to_sdpa_unchanged():
    sdpa, packed = twins()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        a = sdpa(input_ids=ids, attention_mask=mask).logits
        b = packed(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(b[1, 5:], a[1, 5:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
        # decoding with a cache: one query against many keys
        ga = sdpa.generate(ids[:1], max_new_tokens=4, do_sample=False)
        gb = packed.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(ga, gb)


class _Causal(torch.nn.Module):
    is_causal = True


def test_a_feature_it_does_not_lay_out_gets_the_block_mask():
    """A sliding window (wider than the row here) takes HF's sdpa with the block mask it would have
    built: each sequence still attends only to itself."""
    g = torch.Generator().manual_seed(2)
    lengths = [5, 11]
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = packed_attention.packed_attention(_Causal(), q, k, v, None, position_ids=pos, sliding_window=64)
    fast, _ = packed_attention.packed_attention(_Causal(), q, k, v, None, position_ids=pos)
    torch.testing.assert_close(out, fast, atol=1e-6, rtol=1e-5)
    start = 0
    for n in lengths:
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[..., start : start + n, :], k[..., start : start + n, :], v[..., start : start + n, :], is_causal=True
        )
        torch.testing.assert_close(out[0, start : start + n], alone[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
        start += n


def test_position_ids_changed_in_place_are_packed_again():
    pos = torch.tensor([[0, 1, 2, 3, 4, 5]])
    first = packed_attention._packing(pos)
    assert (first.sequences, first.longest) == (1, 6)
    pos[0, 3:] = torch.arange(3)  # now two sequences of three
    second = packed_attention._packing(pos)
    assert (second.sequences, second.longest) == (2, 3)


@pytest.mark.parametrize(
    ("positions", "sequences", "longest"),
    [([[0, 1, 2]], 1, 3), ([[0, 0, 0]], 3, 1), ([[0, 1, 0, 1], [0, 1, 2, 3]], 3, 4), ([[5, 6, 0, 1]], 2, 2)],
)
def test_sequences_start_where_positions_do_not_step_by_one(positions, sequences, longest):
    packing = packed_attention.Packing.of(torch.tensor(positions))
    assert (packing.sequences, packing.longest) == (sequences, longest)
    total = len(positions) * len(positions[0])
    assert sorted(packing.gather[packing.scatter].tolist()) == list(range(total))  # every token, once
