"""The engine's prefix cache (actors/rollout/prefix_cache.py) as a container: the longest common
prefix wins, short ones are not worth a copy, the token budget evicts the least recently used, and
`clear` forgets everything. The engine's use of it is tested end to end in test_engine.py."""

from __future__ import annotations

import torch

from actors.rollout.prefix_cache import MIN_SHARED, PrefixCache


def _kv(n: int, mark: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full((2, n, 4), mark)], [torch.full((2, n, 4), -mark)]


def test_the_entry_sharing_the_longest_prefix_is_found_and_its_length_said():
    cache = PrefixCache(budget=1000)
    a = list(range(100))
    b = list(range(60)) + [999] * 40
    cache.put(a, *_kv(100, 1.0), None)
    cache.put(b, *_kv(100, 2.0), torch.zeros(8))
    entry, shared = cache.match(list(range(80)) + [5, 5])
    assert shared == 80 and float(entry.keys[0][0, 0, 0]) == 1.0
    entry, shared = cache.match(list(range(60)) + [999] * 50)
    assert shared == 100 and float(entry.keys[0][0, 0, 0]) == 2.0  # the whole of b, then more
    assert cache.match([7] * 100) is None
    assert cache.match(list(range(MIN_SHARED - 1)) + [-1] * 20) is None  # too short a prefix to copy
    assert (cache.hits, cache.shared) == (2, 180)


def test_the_budget_evicts_the_least_recently_used_and_clear_forgets_all():
    cache = PrefixCache(budget=250)
    for i in range(3):
        cache.put([i] + list(range(99)), *_kv(100, float(i)), None)
    assert cache.held <= 250 and len(cache.entries) == 2  # the first went
    assert cache.match([0] + list(range(99))) is None
    cache.match([1] + list(range(99)))  # 1 is now more recent than 2
    cache.put([3] + list(range(99)), *_kv(100, 3.0), None)
    assert cache.match([1] + list(range(99))) is not None and cache.match([2] + list(range(99))) is None
    cache.put(list(range(300)), *_kv(300, 9.0), None)  # larger than the whole budget: not kept
    assert cache.held <= 250
    cache.clear()
    assert cache.held == 0 and cache.match([1] + list(range(99))) is None


def test_a_copy_is_kept_not_the_callers_tensors():
    cache = PrefixCache(budget=100)
    keys, values = _kv(20, 1.0)
    cache.put(list(range(20)), keys, values, None)
    keys[0].fill_(5.0)  # the slot is reused by another row
    entry, _ = cache.match(list(range(20)))
    assert float(entry.keys[0].max()) == 1.0
