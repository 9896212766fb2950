"""PrefixCache: which physical block holds which content (vLLM v1's prefix caching). A full
block's key chains a SHA-256 digest of its parent block's key with its own token ids, so a hit
is verified by content and by a cryptographic chain, never by Python's hash() alone.
Registered blocks that no sequence references stay here, evictable in LRU order, until the
block manager needs a fresh block."""

import hashlib
from collections import OrderedDict

from pagedbench.engine.sequence import Sequence

# (digest of the parent block's key, b"" for the first block; this block's token ids)
BlockKey = tuple[bytes, tuple[int, ...]]


def key_digest(key: BlockKey) -> bytes:
    """SHA-256 of a block key: the parent link of the next block (never Python's hash())."""
    return hashlib.sha256(key[0] + repr(key[1]).encode()).digest()


def chained_key(parent: BlockKey | None, token_ids) -> BlockKey:
    """The key of a block holding `token_ids` after the block keyed `parent` (None: the first block)."""
    return (b"" if parent is None else key_digest(parent)), tuple(token_ids)


def block_key(seq: Sequence, index: int, block_size: int) -> BlockKey:
    """The key of `seq`'s logical block `index` (its keys before it must be in seq.block_keys)."""
    parent = seq.block_keys[index - 1] if index else None
    return chained_key(parent, seq.token_ids[index * block_size : (index + 1) * block_size])


class PrefixCache:
    def __init__(self):
        self.cached: dict[BlockKey, int] = {}  # key -> block holding that content
        self.key_of: dict[int, BlockKey] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, least recently freed first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found cached

    @property
    def num_cached(self) -> int:
        """Blocks registered (held or evictable)."""
        return len(self.cached)

    def take(self, key: BlockKey) -> int | None:
        """The block holding `key`'s content (no longer evictable), or None."""
        block = self.cached.get(key)
        if block is not None:
            self.evictable.pop(block, None)
        return block

    def register(self, key: BlockKey, block: int) -> None:
        """`block` holds `key`'s content, unless another block already does (or `block` holds another)."""
        if key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key

    def release(self, block: int) -> bool:
        """An unreferenced block: kept (evictable) if registered; False if not, so it is plain free."""
        if block not in self.key_of:
            return False
        self.evictable[block] = None
        return True

    def evict(self) -> int:
        """The least recently freed evictable block, unregistered."""
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.key_of.pop(block)]
        return block

    def reset(self) -> list[int]:
        """Forget everything; returns the evictable blocks, free from now on."""
        freed = list(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.key_of.clear()
        return freed
