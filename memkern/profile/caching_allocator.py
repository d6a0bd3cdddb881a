"""What a device's allocator reports for a sequence of allocations and frees.

The planner (:mod:`memkern.profile.plan`) knows when each tensor storage is created and freed,
and its size in bytes; what ``torch.cuda.max_memory_allocated()`` reports is not the sum of
those sizes but of the *blocks* PyTorch's CUDA caching allocator hands out for them.
:class:`CudaCachingAllocator` replays the rules of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator::malloc`` / ``free``, default settings: one stream, no
``max_split_size``, no ``roundup_power2_divisions``, no expandable segments):

* every request is rounded up to a multiple of 512 bytes (at least 512);
* requests of at most 1 MiB come from the *small* pool, larger ones from the *large* pool;
* a request takes the smallest cached free block of its pool that fits (ties: the lowest
  address); when none fits, a new segment is reserved from the device: 2 MiB for a small
  request, 20 MiB for a request under 10 MiB, else the request rounded up to 2 MiB;
* the block found is split when what remains is at least 512 bytes (small pool) or more than
  1 MiB (large pool); otherwise the whole block is handed out, and counted as allocated;
* a freed block merges with free neighbours of its segment and stays cached (segments are
  never returned to the device: no ``empty_cache`` and no out-of-memory retry is modelled).

"Allocated" is the sum of the sizes of the blocks handed out, as the allocator's
``allocated_bytes`` statistic counts it. :class:`ExactAllocator` is the CPU's: each storage
counts its own bytes (what the profiler's allocation trace reports). :class:`HostAllocator` is
the host memory that offloading takes (pinned and pageable).
"""
from __future__ import annotations

import bisect
import dataclasses

from memkern._host import footprint

MIN_BLOCK = 512
"""kMinBlockSize: every request is rounded up to a multiple of this."""
SMALL_SIZE = 1 << 20
"""kSmallSize: the largest request served by the small pool."""
SMALL_BUFFER = 2 << 20
"""kSmallBuffer: the segment a small request reserves."""
LARGE_BUFFER = 20 << 20
"""kLargeBuffer: the segment a request between 1 and 10 MiB reserves."""
MIN_LARGE_ALLOC = 10 << 20
"""kMinLargeAlloc: requests from this size on reserve a segment of their own size."""
ROUND_LARGE = 2 << 20
"""kRoundLarge: those segments are rounded up to this."""


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 bytes, at least 512."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """``get_allocation_size``: the segment reserved for a (rounded) request nothing cached fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclasses.dataclass(eq=False)
class _Block:
    ptr: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


class CudaCachingAllocator:
    """The CUDA caching allocator's bookkeeping, without a device (see the module docstring).

    ``malloc(nbytes)`` returns a handle, ``free(handle)`` gives the block back; ``allocated``
    and ``reserved`` are the current totals, ``peak_allocated`` the highest ``allocated`` so far
    (``reset_peak()`` sets it to the current value, as ``torch.cuda.reset_peak_memory_stats``).
    """

    def __init__(self) -> None:
        # free cached blocks of each pool, sorted as the allocator's std::set: (size, address)
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._next_address = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0

    def malloc(self, nbytes: int) -> _Block | None:
        if nbytes == 0:  # the allocator returns no block for an empty request
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            reserved = segment_size(size)
            block = _Block(self._next_address, reserved, small)
            self._next_address += reserved
            self.reserved += reserved
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.ptr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            bisect.insort(pool, (rest.size, rest.ptr, rest))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        pool = self._free[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            del pool[bisect.bisect_left(pool, (neighbour.size, neighbour.ptr))]
            if neighbour is block.prev:
                block.ptr = neighbour.ptr
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
        bisect.insort(pool, (block.size, block.ptr, block))

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated

    @staticmethod
    def size_of(block: _Block | None) -> int:
        """Bytes the allocator counts for the block ``malloc`` returned."""
        return 0 if block is None else block.size


class ExactAllocator:
    """An allocator whose "allocated" is the sum of the requested bytes (the CPU's, as the
    profiler's allocation trace reports it). Same interface as :class:`CudaCachingAllocator`."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0

    def malloc(self, nbytes: int) -> int:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return nbytes

    def free(self, handle: int) -> None:
        self.allocated -= handle

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated

    @staticmethod
    def size_of(handle: int) -> int:
        return handle


class HostAllocator:
    """Host memory as offloading takes it (:data:`memkern._host.KINDS`): "pinned" buffers from
    torch's pinned caching allocator (``CachingHostAllocator``: each request rounded up to a
    power of two, :func:`memkern._host.footprint`; a freed block is cached for the next request
    of its rounded size and never returned to the system), "pinned exact" ones page-locked at
    their size, pageable ones at their size.

    ``malloc(nbytes, kind)`` returns a handle, ``free(handle)`` gives it back; ``allocated``
    is the bytes held from the system now (the caching allocator's blocks, cached ones
    included, and the live buffers of the other kinds), ``peak_allocated`` the highest so far,
    ``pinned`` the page-locked bytes, ``cached`` the free cached blocks' total.
    """

    def __init__(self) -> None:
        self._cached: dict[int, int] = {}  # rounded size -> free cached blocks of that size
        self.pinned = 0
        self.cached = 0
        self.pageable = 0
        self.peak_allocated = 0

    @property
    def allocated(self) -> int:
        return self.pinned + self.pageable

    def malloc(self, nbytes: int, kind: str) -> tuple[int, str]:
        size = footprint(nbytes, kind)
        if kind == "pageable":
            self.pageable += size
        elif kind == "pinned" and self._cached.get(size):
            self._cached[size] -= 1
            self.cached -= size
        else:
            self.pinned += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return size, kind

    def free(self, handle: tuple[int, str]) -> None:
        size, kind = handle
        if kind == "pinned":
            self._cached[size] = self._cached.get(size, 0) + 1
            self.cached += size
        elif kind == "pinned exact":
            self.pinned -= size
        else:
            self.pageable -= size
