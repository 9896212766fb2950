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
entry becomes NO_BLOCK (the step plan points it at the padding page, and no backend reads keys
outside the window). Models that mix global and local layers (Gemma 2/3) keep every page: one
page holds a block of tokens for all layers, and the global layers read every one.

Swap space (preemption by swap): a pool of CPU blocks. `swap_out` moves a sequence's pages there
(queued (device block, CPU block) copies, the device blocks freed), `swap_in` back into fresh
device blocks; the engine runs the copies before the step, swap-outs first.
"""

from collections import deque

from pagedbench.engine.prefix_cache import PrefixCache, block_key
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.state_snapshots import SnapshotPlan, StateSnapshots


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


class BlockManager:
    """Owns the physical KV blocks: free blocks (never used or evicted), evictable cached blocks
    (unreferenced, still registered; LRU), a reference count per block, and each sequence's block
    table (`Sequence.block_table`, logical block i -> physical block)."""

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
        self.num_blocks = num_blocks
        # Hybrid models: a sequence holding pages also holds one linear-attention state slot; a fork's
        # slot starts as a copy of its parent's, and a swapped-out sequence's state moves to a CPU slot
        # (numbered after the device's running and snapshot slots) and back with its pages.
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self.pending_state_copies: list[tuple[int, int]] = []  # (source slot, slot), for the engine
        # Their prefix caching: DeltaNet state snapshots at block boundaries, in slots after the running ones.
        self.snapshots = None
        if num_state_slots and enable_prefix_caching and state_snapshots is not None and state_snapshots.count:
            self.snapshots = StateSnapshots(num_state_slots, state_snapshots, block_size)
        self.first_cpu_state_slot = num_state_slots + (state_snapshots.count if state_snapshots is not None else 0)
        self._cpu_state_slots: deque[int] = deque(
            range(self.first_cpu_state_slot, self.first_cpu_state_slot + num_cpu_state_slots)
        )
        self.sliding_window = sliding_window  # set only when every layer is windowed
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, CPU block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (CPU block, device block)
        self._cpu_releasing: list[int] = []  # read by a pending swap-in: free once the copies are taken
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self.prefix_cache = PrefixCache()  # registered blocks; the unreferenced ones are free but evictable
        self._num_shared = 0  # blocks with a reference count above 1
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) blocks, for the engine

    @property
    def free_blocks(self) -> list[int]:
        return [*self._fresh, *self.prefix_cache.evictable]

    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self.prefix_cache.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_cache.cached)

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
        return self.prefix_cache.queries

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens found in the prefix cache."""
        return self.prefix_cache.hits

    @property
    def num_shared_blocks(self) -> int:
        """Blocks read by more than one sequence right now."""
        return self._num_shared

    def _shared_writes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indices in `seq`'s block table of shared blocks that tokens up to `num_tokens` write into."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), blocks_needed(num_tokens, self.block_size))
        return [i for i in range(first, last) if self.ref_counts[seq.block_table[i]] > 1]

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` tokens fit in the cache
        (new pages, plus private copies of shared pages it will write into)."""
        released = seq.cpu_block_table.count(NO_BLOCK)  # a swapped-out sequence's released pages stay released
        grow = max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table) - released)
        return grow + len(self._shared_writes(seq, num_tokens))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.num_state_slots and not self._on_device(seq) and not self._free_slots:
            return False
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def _on_device(self, seq: Sequence) -> bool:
        """Whether `seq` holds a device state slot (not none, not a swapped-out state's CPU slot)."""
        return 0 <= seq.state_slot < self.first_cpu_state_slot

    def _take_slot(self, seq: Sequence) -> None:
        if self.num_state_slots and not self._on_device(seq):
            if not self._free_slots:
                raise RuntimeError("out of linear-attention state slots")
            cpu, seq.state_slot = seq.state_slot, self._free_slots.popleft()
            if cpu >= 0:  # swapped back in: its state returns from its CPU slot (read before any reuse)
                self.pending_state_copies.append((cpu, seq.state_slot))
                self._cpu_state_slots.append(cpu)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (source slot, slot) state copies queued since the last call (forks, snapshot restores,
        swaps out and in), as one set that reads every source before writing any slot: each slot's
        copy from where its content comes in queue order (a fork's child swapped out in the next
        schedule takes its parent's state to the CPU slot), the last copy into a slot winning."""
        origin: dict[int, int] = {}
        for src, dst in self.pending_state_copies:
            origin[dst] = origin.get(src, src)
        self.pending_state_copies = []
        return [(src, dst) for dst, src in origin.items() if src != dst]

    def _take(self) -> int:
        block = self._fresh.popleft() if self._fresh else self.prefix_cache.evict()
        if self.ref_counts[block] != 0:  # an engine bug: raised, not asserted (python -O keeps it)
            raise RuntimeError(f"block {block} on the free list is referenced")
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s first `num_tokens` tokens writable: grow its block table with fresh (or
        evicted) blocks, and give it a private copy of any shared block it will write into."""
        n = self.num_new_blocks(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free_blocks}")
        self._take_slot(seq)
        if seq.restore_from >= 0:  # a prefix hit resumes from a state snapshot: copied before the step
            self.pending_state_copies.append((seq.restore_from, seq.state_slot))
            self.snapshots.mark_restored(seq.restore_from)
            seq.restore_from = -1
        if self.snapshots is not None:
            self.snapshots.plan(seq, num_tokens)
        for index in self._shared_writes(seq, num_tokens):
            shared = seq.block_table[index]
            self._unref(shared)
            seq.block_table[index] = self._take()
            self.pending_copies.append((shared, seq.block_table[index]))
        while len(seq.block_table) < blocks_needed(num_tokens, self.block_size):
            seq.block_table.append(self._take())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` reads all of `parent`'s pages (one more reference each; nothing is copied)."""
        assert not child.block_table, "a fork starts with no blocks of its own"
        # A parent holding no device state (preempted to recompute) forks a child that recomputes too.
        state = self.num_state_slots and self._on_device(parent)
        if state and not self._free_slots:  # before any reference is taken
            raise RuntimeError("out of linear-attention state slots")
        for block in _held(parent.block_table):
            self.ref_counts[block] += 1
            self._num_shared += self.ref_counts[block] == 2
        child.block_table = list(parent.block_table)
        if state:  # the child continues from the parent's state: a copy of its slot
            self._take_slot(child)
            self.pending_state_copies.append((parent.state_slot, child.state_slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call; the engine copies
        their K/V before the step that writes into dst."""
        latest = {dst: src for src, dst in self.pending_copies}  # a block freed and retaken: its last copy
        self.pending_copies = []
        return [(src, dst) for dst, src in latest.items()]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; an unreferenced block becomes free, evictable if cached."""
        for block in reversed(_held(seq.block_table)):
            self._unref(block)
        self._cpu_free.extend(_held(seq.cpu_block_table))
        seq.block_table, seq.cpu_block_table = [], []
        seq.block_keys = []
        if seq.state_slot >= 0:
            (self._free_slots if self._on_device(seq) else self._cpu_state_slots).append(seq.state_slot)
            seq.state_slot = -1
        if self.snapshots is not None:
            self.snapshots.release(seq)

    # ---- swap space ---------------------------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        state_room = not self.num_state_slots or bool(self._cpu_state_slots)
        return 0 < len(_held(seq.block_table)) <= len(self._cpu_free) and state_room

    def swap_out(self, seq: Sequence) -> None:
        """Move `seq`'s pages to swap space (shared pages are copied; its references dropped)."""
        for block in seq.block_table:
            cpu = NO_BLOCK if block == NO_BLOCK else self._cpu_free.popleft()
            if block != NO_BLOCK:
                self.pending_swap_out.append((block, cpu))
            seq.cpu_block_table.append(cpu)
        for block in reversed(_held(seq.block_table)):
            self._unref(block)
        seq.block_table = []
        seq.block_keys = []  # its pages come back as fresh blocks, registered again once cached
        if self._on_device(seq):  # a hybrid's state moves out with its pages (its device slot is free)
            cpu = self._cpu_state_slots.popleft()
            self.pending_state_copies.append((seq.state_slot, cpu))
            self._free_slots.append(seq.state_slot)
            seq.state_slot = cpu

    def swap_in(self, seq: Sequence) -> None:
        """Bring a swapped-out sequence's pages back into fresh device blocks (check can_allocate first)."""
        for cpu in seq.cpu_block_table:
            block = NO_BLOCK if cpu == NO_BLOCK else self._take()
            if cpu != NO_BLOCK:
                self.pending_swap_in.append((cpu, block))
            seq.block_table.append(block)
        self._cpu_releasing += _held(seq.cpu_block_table)
        seq.cpu_block_table = []

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins) queued since the last call."""
        swaps = self.pending_swap_out, self.pending_swap_in
        self.pending_swap_out, self.pending_swap_in = [], []
        self._cpu_free.extend(self._cpu_releasing)
        self._cpu_releasing = []
        return swaps

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
            self._unref(table[index])
            table[index] = NO_BLOCK

    def trim(self, seq: Sequence) -> None:
        """Free `seq`'s pages past its computed tokens: those it took for proposed tokens that
        verification rejected (fresh pages, never shared or cached)."""
        keep = blocks_needed(seq.num_computed_tokens, self.block_size)
        for block in reversed(_held(seq.block_table[keep:])):
            self._unref(block)
        del seq.block_table[keep:]

    def _unref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:  # an engine bug: raised, not asserted (python -O keeps it)
            raise RuntimeError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        self._num_shared -= self.ref_counts[block] == 1
        if self.ref_counts[block] == 0 and not self.prefix_cache.release(block):
            self._fresh.append(block)

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
            self.ref_counts[block] += 1
            self._num_shared += self.ref_counts[block] == 2
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
            self._unref(block)
        del seq.block_table[keep:], seq.block_keys[keep:]

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
        self._fresh.extend(self.prefix_cache.reset())
        if self.snapshots is not None:
            self.snapshots.reset()
