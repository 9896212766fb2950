from collections import deque

from pagedbench.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the physical KV blocks: a free list, a reference count per block, and each
    sequence's block table (`Sequence.block_table`, logical block i -> physical block)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` tokens fit in the cache."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        n = self.num_new_blocks(seq, num_tokens)
        if n > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free_blocks)}")
        for _ in range(n):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0, f"block {block} on the free list is referenced"
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; a block returns to the free list when none remain."""
        for block in reversed(seq.block_table):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
