"""BlockPool: the device's KV pages (vLLM v1's BlockPool). Each page has a reference count (the
sequences reading it); a free page is fresh (never used, or evicted) or, registered in the prefix
cache, evictable: its content kept until a fresh page is needed."""

from collections import deque

from pagedbench.engine.prefix_cache import PrefixCache


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache):
        self.ref_counts = [0] * num_blocks
        self.fresh: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self.prefix_cache = prefix_cache  # keeps the unreferenced registered pages, evictable
        self.num_shared = 0  # pages with a reference count above 1

    @property
    def num_free(self) -> int:
        return len(self.fresh) + len(self.prefix_cache.evictable)

    def take(self) -> int:
        """A free page, referenced once: a fresh one, else the least recently freed cached one (evicted)."""
        block = self.fresh.popleft() if self.fresh else self.prefix_cache.evict()
        if self.ref_counts[block] != 0:  # an engine bug: raised, not asserted (python -O keeps it)
            raise RuntimeError(f"block {block} on the free list is referenced")
        self.ref_counts[block] = 1
        return block

    def ref(self, block: int) -> None:
        """One more sequence reads `block` (a fork, a prefix hit)."""
        self.ref_counts[block] += 1
        self.num_shared += self.ref_counts[block] == 2

    def unref(self, block: int) -> None:
        """One sequence fewer reads `block`; unreferenced, it is free (evictable if cached)."""
        if self.ref_counts[block] <= 0:  # an engine bug: raised, not asserted (python -O keeps it)
            raise RuntimeError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        self.num_shared -= self.ref_counts[block] == 1
        if self.ref_counts[block] == 0 and not self.prefix_cache.release(block):
            self.fresh.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page: the evictable ones become fresh (pages in use stay allocated)."""
        self.fresh.extend(self.prefix_cache.reset())
