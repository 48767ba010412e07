"""PagedTokenToKVPoolAllocator: whole pages, page 0 never handed out, free-list policy."""

import random

import pytest
import torch

from pools.allocator import PagedTokenToKVPoolAllocator

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    """Page ids of a whole-page allocation; checks every page is complete and in slot order."""
    rows = slots.cpu().reshape(-1, page_size)  # [num_pages, page_size]
    starts = rows[:, 0]
    assert torch.equal(rows, starts[:, None] + torch.arange(page_size))
    assert not bool((starts % page_size).any())
    return (starts // page_size).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size, page_size", [(16, 1), (64, 4), (70, 8)])
def test_alloc_whole_pages_never_page_zero(device, size, page_size):
    alloc = PagedTokenToKVPoolAllocator(size, page_size, device=device)
    num_pages = size // page_size
    assert alloc.num_pages == num_pages and alloc.available_size() == num_pages * page_size
    slots = alloc.alloc(2 * page_size)
    assert slots.dtype == torch.int64 and slots.device.type == device
    assert pages_of(slots, page_size) == [1, 2]  # lowest free pages first
    rest = alloc.alloc_pages(num_pages - 2)
    got = pages_of(rest, page_size) + [1, 2]
    assert sorted(got) == list(range(1, num_pages + 1))  # every page once, never page 0
    assert alloc.available_size() == 0
    assert alloc.alloc(page_size) is None
    assert int(rest.max()) < (num_pages + 1) * page_size  # inside a [size + page_size] buffer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_sequence_invariants(device, page_size):
    alloc = PagedTokenToKVPoolAllocator(40, page_size, device=device)
    rng = random.Random(page_size)
    held: list[list[int]] = []  # pages per live allocation
    for _ in range(400):
        total = sum(len(p) for p in held)
        if rng.random() < 0.55:
            n = rng.randint(0, 4)
            before = alloc.available_size()
            slots = alloc.alloc_pages(n)
            if n > alloc.num_pages - total:
                assert slots is None and alloc.available_size() == before
            else:
                pages = pages_of(slots, page_size)
                flat = {p for h in held for p in h}
                assert 0 not in pages and not flat & set(pages) and len(set(pages)) == n
                held.append(pages)
        elif held:
            pages = held.pop(rng.randrange(len(held)))
            slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)], device=device)
            alloc.free(slots)
        total = sum(len(p) for p in held)
        assert alloc.available_size() == (alloc.num_pages - total) * page_size
    alloc.clear()
    assert alloc.available_size() == alloc.num_pages * page_size
    assert pages_of(alloc.alloc_pages(alloc.num_pages), page_size) == list(range(1, alloc.num_pages + 1))


def test_freed_pages_merge_back_sorted_when_needed():
    alloc = PagedTokenToKVPoolAllocator(8, 1)
    first = alloc.alloc(6)  # pages 1..6; free list [7, 8]
    alloc.free(first[[4, 1]])  # pages 5, 2 released
    assert alloc.alloc(1).tolist() == [7]  # sorted free list first: released pages wait
    assert alloc.alloc(2).tolist() == [2, 5]  # list short ([8]): merge, sort, take lowest
    assert alloc.alloc(1).tolist() == [8]


def test_free_covers_the_pages_touched():
    alloc = PagedTokenToKVPoolAllocator(32, 4)
    slots = alloc.alloc(8)  # pages 1, 2
    alloc.free(slots[:5])  # a prefix ending inside page 2 releases pages 1 and 2 (SGLang's rule)
    assert alloc.available_size() == 32
    with pytest.raises(ValueError, match=r"pages \[1\] are not allocated"):
        alloc.free(slots[:1])


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([0], ValueError, r"pages \[0\] are not allocated"),  # the padding page
        ([3], ValueError, r"pages \[0\] are not allocated"),
        ([12], ValueError, r"pages \[3\] are not allocated"),  # never handed out
        ([36], ValueError, r"must lie in \[0, 36\)"),
        ([-1], ValueError, "must lie in"),
        ([[4, 5]], ValueError, r"pages \[1\] are not allocated"),  # reshaped to 1-D, after the free below
        (torch.tensor([4.0]), TypeError, "integer tensor"),
    ],
)
def test_free_rejects_foreign_and_double(bad, exc, match):
    alloc = PagedTokenToKVPoolAllocator(32, 4)  # pages 1..8, slots up to 35
    a, b = alloc.alloc(4), alloc.alloc(4)  # pages 1, 2
    alloc.free(a)
    before = alloc.available_size()
    with pytest.raises(exc, match=match):
        alloc.free(bad)
    assert alloc.available_size() == before
    alloc.free(b)  # a failed free changed nothing


def test_failed_free_frees_nothing():
    alloc = PagedTokenToKVPoolAllocator(16, 2)
    a = alloc.alloc(4)  # pages 1, 2
    with pytest.raises(ValueError, match=r"pages \[3\]"):
        alloc.free(torch.cat([a[:2], torch.tensor([6])]))
    alloc.free(a)  # page 1 was not freed by the failed call
    assert alloc.available_size() == 16


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda a: a.alloc(3), ValueError, "multiple of page_size=4, got 3"),
        (lambda a: a.alloc(-4), ValueError, "non-negative multiple"),
        (lambda a: a.alloc(4.0), TypeError, "need_size must be an int"),
        (lambda a: a.alloc_pages(True), TypeError, "num_pages must be an int"),
        (lambda a: a.alloc_pages(-1), ValueError, "non-negative multiple"),
    ],
)
def test_alloc_rejects_bad_sizes(call, exc, match):
    with pytest.raises(exc, match=match):
        call(PagedTokenToKVPoolAllocator(32, 4))


def test_alloc_zero_is_empty():
    alloc = PagedTokenToKVPoolAllocator(8, 4)
    assert alloc.alloc(0).numel() == 0 and alloc.available_size() == 8
    alloc.free(torch.empty(0, dtype=torch.int64))
    alloc.free([])


@pytest.mark.parametrize(
    "size, page_size, exc, match",
    [(3, 4, ValueError, "size >= page_size"), (8, 0, ValueError, "page_size > 0"), (8.0, 4, TypeError, "size must be an int")],
)
def test_constructor_rejects_bad_input(size, page_size, exc, match):
    with pytest.raises(exc, match=match):
        PagedTokenToKVPoolAllocator(size, page_size)
