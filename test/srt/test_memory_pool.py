"""TokenToKVPoolAllocator: a device-side ring of free slots (no host round trips)."""
import pytest
import torch

from sglang.srt.mem_cache.memory_pool import TokenToKVPoolAllocator


def test_alloc_free_wraps_around_and_never_repeats_live_slots():
    alloc = TokenToKVPoolAllocator(10, "cpu")
    live = []
    gen = torch.Generator().manual_seed(0)
    for step in range(200):
        if live and (alloc.available_size() == 0 or torch.rand(1, generator=gen) < 0.5):
            alloc.free(live.pop(int(torch.randint(len(live), (1,), generator=gen))))
        else:
            n = int(torch.randint(1, alloc.available_size() + 1, (1,), generator=gen))
            got = alloc.alloc(n)
            assert got is not None and got.numel() == n
            live.append(got)
        held = torch.cat(live).tolist() if live else []
        assert len(held) == len(set(held)) and all(1 <= s <= 10 for s in held), step
        assert alloc.available_size() == 10 - len(held)
    assert alloc.alloc(alloc.available_size() + 1) is None


def test_alloc_returns_a_copy_and_overfree_is_an_error():
    alloc = TokenToKVPoolAllocator(4, "cpu")
    a = alloc.alloc(3)
    alloc.free(a[:1])
    b = alloc.alloc(2)  # reuses ring positions that a's view would have aliased
    assert a.tolist() == [1, 2, 3] and sorted(b.tolist()) == [1, 4]
    with pytest.raises(ValueError, match="in use"):
        alloc.free(torch.arange(1, 6))
