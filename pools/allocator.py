"""Paged token-slot allocator: hands out whole pages of a KV pool's token slots.

A KV pool of ``size`` tokens and ``page_size`` has buffers of ``size + page_size`` rows: page
``p`` holds token slots ``p * page_size .. (p + 1) * page_size - 1``, and page 0 (slots
``0..page_size - 1``) is the padding page dummy writes land in. The allocator manages pages
``1..num_pages`` with ``num_pages = size // page_size`` (a trailing partial page is unused);
it never hands out page 0. Decode reserves a request's destination pages with it.

Free-list policy (SGLang's): free pages are kept sorted ascending and ``alloc`` takes the
lowest-numbered ones; freed pages wait in a release list and are merged back, sorted, when an
``alloc`` needs more pages than the sorted list holds (or on :meth:`merge_and_sort_free`). So
recently freed pages are reused last, and ``alloc`` never sorts on the common path.

Bookkeeping is on the host: indices passed to ``free`` are validated there (one device sync
on CUDA), so a double free or a slot this allocator did not hand out is a ``ValueError``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from pools._checks import check_indices


class PagedTokenToKVPoolAllocator:
    """Whole-page allocator over ``size`` token slots (see the module docstring).

    - ``alloc(need_size)``: ``need_size`` (a multiple of ``page_size``) token slot indices,
      int64 on ``device``, page by page in ascending slot order within a page; None when
      fewer free pages remain (nothing changes then);
    - ``alloc_pages(num_pages)``: the same for ``num_pages * page_size`` slots;
    - ``free(indices)``: releases every page that one of the token slot indices falls in;
      each such page must be allocated, else ``ValueError`` and nothing is freed;
    - ``available_size()``: free token slots (free pages * page_size).
    """

    def __init__(self, size: int, page_size: int, device: str = "cpu"):
        for name, value in (("size", size), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if page_size <= 0 or size < page_size:
            raise ValueError(f"need page_size > 0 and size >= page_size, got size={size}, page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        """Every page 1..num_pages free again, sorted."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.release_pages: List[torch.Tensor] = []
        self._num_free = self.num_pages
        self._allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool)  # [num_pages + 1]

    def available_size(self) -> int:
        return self._num_free * self.page_size

    def merge_and_sort_free(self) -> None:
        """Fold released pages into the sorted free list."""
        if self.release_pages:
            self.free_pages = torch.cat([self.free_pages, *self.release_pages]).sort().values
            self.release_pages = []

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if not isinstance(need_size, int) or isinstance(need_size, bool):
            raise TypeError(f"need_size must be an int, got {type(need_size).__name__}")
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(f"need_size must be a non-negative multiple of page_size={self.page_size}, got {need_size}")
        num_pages = need_size // self.page_size
        if num_pages > self._num_free:
            return None
        if num_pages > self.free_pages.numel():
            self.merge_and_sort_free()
        pages = self.free_pages[:num_pages]  # [num_pages]
        self.free_pages = self.free_pages[num_pages:]
        self._allocated[pages] = True
        self._num_free -= num_pages
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + offsets).reshape(-1)  # [num_pages * page_size]
        return slots.to(self.device)

    def alloc_pages(self, num_pages: int) -> Optional[torch.Tensor]:
        """Token slot indices of ``num_pages`` whole pages (see :meth:`alloc`)."""
        if not isinstance(num_pages, int) or isinstance(num_pages, bool):
            raise TypeError(f"num_pages must be an int, got {type(num_pages).__name__}")
        return self.alloc(num_pages * self.page_size)

    def free(self, indices) -> None:
        """Release the pages the token slot ``indices`` fall in (all of them or, on error, none)."""
        idx = torch.as_tensor(indices).reshape(-1)
        if idx.numel() == 0:  # [] arrives as float32
            return
        idx = check_indices("indices", idx, (self.num_pages + 1) * self.page_size, device="cpu")
        pages = torch.unique(idx // self.page_size)
        held = self._allocated[pages]
        if not bool(held.all()):
            raise ValueError(
                f"double free or foreign indices: pages {pages[~held].tolist()} are not allocated "
                f"(page_size={self.page_size}; page 0 is never allocated)"
            )
        self._allocated[pages] = False
        self.release_pages.append(pages)
        self._num_free += pages.numel()
