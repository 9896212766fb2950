"""Physical KV blocks: reference counts, each sequence's block table, and the prefix cache.

Prefix caching (as vLLM v1): a full block is registered under a key chaining its parent's key
with its own token ids: a newly admitted prompt's blocks when the step that computes them is
scheduled (so requests admitted after it in that step share them; a step that fails forgets
the cache), other blocks once their K/V are computed. A new request's prompt looks its full blocks
up in order and takes the hits (reference counted: several sequences read one page), so their
tokens are never recomputed. A freed block that is registered stays in an LRU pool of evictable
blocks, revived by a later hit and evicted (unregistered) only when a fresh block is needed.
The key holds the block's token ids and a SHA-256 digest of its parent's key, so a hit is
verified by content and by a cryptographic chain, never by Python's hash() alone.

Forks (parallel samples, beams) share every page of their parent. A page is written only where a
sequence's next tokens go; when that page is shared, the writer first gets a private copy
(copy-on-write): `allocate` swaps in a fresh block and queues (source, destination) for the
engine, which copies the K/V before the step runs. Only a partial last page can be written while
shared, so a fork costs at most one page copy per sequence.

Sliding windows (as vLLM v1): when every layer of the model is windowed (Mistral), a page whose
tokens have all fallen out of the window of the sequence's next token is released; its table
entry becomes NO_BLOCK (the step batch points it at the padding page, and no backend reads keys
outside the window). Models that mix global and local layers (Gemma 2/3) keep every page: one
page holds a block of tokens for all layers, and the global layers read every one.

The pages themselves are the pool's (block_pool.py); a swapped-out sequence's go to the CPU's
(swap_space.py), and a hybrid's DeltaNet state slot goes with them (state_slots.py).
"""

from pagedbench.engine.block_pool import BlockPool
from pagedbench.engine.prefix_cache import PrefixCache, block_key
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.state_slots import StateSlots
from pagedbench.engine.state_snapshots import SnapshotPlan, StateSnapshots
from pagedbench.engine.swap_space import SwapSpace


def _needs_prompt_logits(seq: Sequence) -> bool:
    """Prompt logprobs not all computed yet: every prompt token must run (a cached one has no logits)."""
    if getattr(seq.params, "prompt_logprobs", None) is None:
        return False
    return len(seq.prompt_logprobs or ()) < seq.num_prompt_tokens - 1


NO_BLOCK = -1  # a block-table entry whose page a sliding window released


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _held(table: list[int]) -> list[int]:
    """The pages a block table (or swap table) actually holds."""
    return [block for block in table if block != NO_BLOCK]


def _replace(seq: Sequence, table: list[int]) -> None:
    seq.block_table = table
    seq.block_table_version += 1  # the worker's copy of the old list is stale (Sequence.block_table_version)


def _cut(seq: Sequence, keep: int) -> None:
    """Drop `seq`'s block-table entries from `keep` on (their references already dropped)."""
    if keep < len(seq.block_table):
        del seq.block_table[keep:]
        seq.block_table_version += 1


class BlockManager:
    """Each sequence's pages: its block table (`Sequence.block_table`, logical block i -> physical
    block) over the pool's pages, copy-on-write, swap space, the prefix cache's lookups and
    registrations, and a hybrid's state slot (`state_slots`) beside its pages."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
        num_state_slots: int = 0,
        state_snapshots: SnapshotPlan | None = None,
        num_cpu_state_slots: int = 0,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # set only when every layer is windowed
        self.prefix_cache = PrefixCache()  # which page holds which content
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) blocks, for the engine
        # Hybrid models: their prefix caching snapshots the DeltaNet state at block boundaries, in
        # slots after the running ones (and the CPU's slots come after those).
        num_snapshots = state_snapshots.count if state_snapshots is not None else 0
        self.num_state_slots = num_state_slots
        self.state_slots = StateSlots(num_state_slots, num_state_slots + num_snapshots, num_cpu_state_slots)
        self.snapshots = None
        if num_state_slots and enable_prefix_caching and num_snapshots:
            self.snapshots = StateSnapshots(num_state_slots, state_snapshots, block_size)
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_space = SwapSpace(num_cpu_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Blocks read by more than one sequence right now."""
        return self.pool.num_shared

    def _shared_writes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indices in `seq`'s block table of shared blocks that tokens up to `num_tokens` write into."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), blocks_needed(num_tokens, self.block_size))
        return [i for i in range(first, last) if self.pool.ref_counts[seq.block_table[i]] > 1]

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` tokens fit in the cache
        (new pages, plus private copies of shared pages it will write into)."""
        released = seq.cpu_block_table.count(NO_BLOCK)  # a swapped-out sequence's released pages stay released
        grow = max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table) - released)
        return grow + len(self._shared_writes(seq, num_tokens))

    def fits_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s first `num_tokens` tokens fit in the pages it holds with nothing to do:
        no new page, no shared page written, no state slot or snapshot to arrange (most decode
        steps; O(pages written) where can_allocate + allocate look at the whole table)."""
        table, size = seq.block_table, self.block_size
        if num_tokens > len(table) * size or seq.cpu_block_table or seq.restore_from >= 0:
            return False
        if self.snapshots is not None or (self.state_slots.num_slots and not self.state_slots.on_device(seq)):
            return False
        refs, first, end = self.pool.ref_counts, seq.num_computed_tokens // size, -(-num_tokens // size)
        if end - first == 1:  # a decode's one page
            return refs[table[first]] == 1
        return all(refs[table[i]] == 1 for i in range(first, end))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.state_slots.can_take(seq) and self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state-slot (source slot, slot) copies queued since the last call (StateSlots.take_copies)."""
        return self.state_slots.take_copies()

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s first `num_tokens` tokens writable: grow its block table with fresh (or
        evicted) blocks, and give it a private copy of any shared block it will write into."""
        n = self.num_new_blocks(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free_blocks}")
        self.state_slots.take(seq)
        if seq.restore_from >= 0:  # a prefix hit resumes from a state snapshot: copied before the step
            self.state_slots.pending_copies.append((seq.restore_from, seq.state_slot))
            self.snapshots.mark_restored(seq.restore_from)
            seq.restore_from = -1
        if self.snapshots is not None:
            self.snapshots.plan(seq, num_tokens)
        for index in self._shared_writes(seq, num_tokens):
            shared = seq.block_table[index]
            self.pool.unref(shared)
            seq.block_table[index] = self.pool.take()
            seq.block_table_version += 1
            self.pending_copies.append((shared, seq.block_table[index]))
        while len(seq.block_table) < blocks_needed(num_tokens, self.block_size):
            seq.block_table.append(self.pool.take())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` reads all of `parent`'s pages (one more reference each; nothing is copied)."""
        assert not child.block_table, "a fork starts with no blocks of its own"
        self.state_slots.fork(parent, child)  # first: out of slots, it raises before any reference is taken
        for block in _held(parent.block_table):
            self.pool.ref(block)
        _replace(child, list(parent.block_table))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call; the engine copies
        their K/V before the step that writes into dst."""
        latest = {dst: src for src, dst in self.pending_copies}  # a block freed and retaken: its last copy
        self.pending_copies = []
        return [(src, dst) for dst, src in latest.items()]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; an unreferenced block becomes free, evictable if cached."""
        for block in reversed(_held(seq.block_table)):
            self.pool.unref(block)
        self.swap_space.free.extend(_held(seq.cpu_block_table))
        _replace(seq, [])
        seq.cpu_block_table = []
        seq.block_keys = []
        self.state_slots.release(seq)
        if self.snapshots is not None:
            self.snapshots.release(seq)

    # ---- swap space ---------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        held = len(_held(seq.block_table))
        return 0 < held <= len(self.swap_space.free) and self.state_slots.can_swap_out()

    def swap_out(self, seq: Sequence) -> None:
        """Move `seq`'s pages to swap space (shared pages are copied; its references dropped)."""
        out = self.swap_space.copy_out
        seq.cpu_block_table = [NO_BLOCK if block == NO_BLOCK else out(block) for block in seq.block_table]
        for block in reversed(_held(seq.block_table)):
            self.pool.unref(block)
        _replace(seq, [])
        seq.block_keys = []  # its pages come back as fresh blocks, registered again once cached
        self.state_slots.swap_out(seq)

    def swap_in(self, seq: Sequence) -> None:
        """Bring a swapped-out sequence's pages back into fresh device blocks (check can_allocate first)."""
        back = self.swap_space.copy_in
        _replace(seq, [NO_BLOCK if cpu == NO_BLOCK else back(cpu, self.pool.take()) for cpu in seq.cpu_block_table])
        seq.cpu_block_table = []

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins) queued since the last call."""
        return self.swap_space.take_copies()

    def release_out_of_window(self, seq: Sequence) -> None:
        """With every layer windowed: release `seq`'s pages that hold no key its next token's
        window reaches (positions before num_computed_tokens - sliding_window + 1)."""
        if self.sliding_window is None:
            return
        first_needed = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        table = seq.block_table
        for index in range(min(first_needed, len(table)) - 1, -1, -1):  # back to the last page released
            if table[index] == NO_BLOCK:
                break
            self.pool.unref(table[index])
            table[index] = NO_BLOCK
            seq.block_table_version += 1

    def trim(self, seq: Sequence) -> None:
        """Free `seq`'s pages past its computed tokens: those it took for proposed tokens that
        verification rejected (fresh pages, never shared or cached)."""
        keep = blocks_needed(seq.num_computed_tokens, self.block_size)
        for block in reversed(_held(seq.block_table[keep:])):
            self.pool.unref(block)
        _cut(seq, keep)

    # ---- prefix cache -----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks yet the cached blocks of its longest cached prefix (full
        blocks, never its last token, which must run to produce logits); returns the tokens hit."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or _needs_prompt_logits(seq):
            return 0
        for index in range((seq.num_tokens - 1) // self.block_size):
            key = block_key(seq, index, self.block_size)
            block = self.prefix_cache.take(key)  # revived if it was evictable
            if block is None:
                break
            self.pool.ref(block)
            seq.block_table.append(block)
            seq.block_keys.append(key)
        if self.num_state_slots:  # a hybrid resumes only where its DeltaNet state was snapshotted
            self._trim_to_snapshot(seq)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = hit
        return hit

    def awaits_snapshot(self, seq: Sequence) -> bool:
        """Whether `seq`, just matched, would resume further from a state snapshot the step being
        scheduled writes: admitted a step later, it skips recomputing that prefix."""
        return seq.snapshot_junction < 0

    def _trim_to_snapshot(self, seq: Sequence) -> None:
        """Keep a hybrid's prefix hit up to its longest block with a state snapshot; past it, the
        matched pages' end becomes the junction its step snapshots for the next request (-1 when
        a snapshot being written this step lies past the kept part: see awaits_snapshot)."""
        matched = len(seq.block_table)
        keep = self.snapshots.resume_point(seq, matched) if self.snapshots is not None else 0
        seq.snapshot_junction = matched * self.block_size if matched > keep else 0
        if matched > keep and self.snapshots is not None and self.snapshots.being_written(seq.block_keys[keep:]):
            seq.snapshot_junction = -1
        for block in reversed(seq.block_table[keep:]):
            self.pool.unref(block)
        _cut(seq, keep)
        del seq.block_keys[keep:]

    def count_lookup(self, seq: Sequence, hit: int) -> None:
        """Record one admitted request's prefix-cache lookup (its prompt tokens, and the hits)."""
        if self.enable_prefix_caching:
            self.prefix_cache.queries += seq.num_tokens
            self.prefix_cache.hits += hit

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register `seq`'s full blocks up to `num_tokens` (default: its computed tokens) whose
        content no other block holds. The scheduler registers an admitted prompt's blocks as it
        schedules them (vLLM v1): a request admitted later in the same step shares them, since
        every layer writes the step's K/V before any attention reads the cache."""
        if not self.enable_prefix_caching:
            return
        if self.snapshots is not None:
            self.snapshots.promote(seq)
        upto = seq.num_computed_tokens if num_tokens is None else num_tokens
        upto = min(upto, seq.num_tokens)  # verified tokens are computed a moment before they are appended
        for index in range(len(seq.block_keys), upto // self.block_size):
            key = block_key(seq, index, self.block_size)
            seq.block_keys.append(key)
            if seq.block_table[index] != NO_BLOCK:  # a page released behind a window (swapped back in) holds nothing
                self.prefix_cache.register(key, seq.block_table[index])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (evictable ones become fresh); blocks in use stay allocated."""
        self.pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset()
