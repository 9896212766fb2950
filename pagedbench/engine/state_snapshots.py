"""Prefix caching for hybrid models: snapshots of the DeltaNet state at block boundaries.

A cached prefix's pages hold K/V for the attention layers only; a DeltaNet layer resumes from its
recurrent state and conv window at the prefix's end, which the pages do not hold. So, as vLLM's
"align" mode does, the state a sequence has after token b is copied into a snapshot slot when b is
the last multiple of `interval` (vLLM's mamba_block_size, a multiple of the page size) that its
step reaches: the DeltaNet layers split that step's chunk at b and copy their state out there.
One per step and sequence: the longest prefix so far is the one a later turn of a conversation
extends, and each snapshot costs a copy of the whole state. A snapshot is keyed by the
prefix-cache key of the block ending at b (a chain over every token before b), so a prefix hit
resumes at the longest matched boundary with a snapshot: the block manager trims the hit there and
queues a copy of the snapshot into the sequence's own slot before the step runs.

Where a hit's pages reach past its last snapshot (a shared system prompt that ends between two
boundaries), the sequence also saves the state at the end of the matched pages, the "junction"
(vLLM's shared-prefix checkpoint): the next request with that prefix resumes there.

A snapshot written by a step is only looked up once that step has run (`promote`). Snapshots live
in a fixed pool of slots after the running sequences' slots in the same state tensors (the copies
in and out are those a fork's state takes: no new kernel), evicted as `StateSnapshots` says."""

from collections import OrderedDict, deque
from dataclasses import dataclass

from pagedbench.engine.prefix_cache import BlockKey, chained_key
from pagedbench.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class SnapshotPlan:
    """`count` snapshot slots (numbered after the running sequences' slots), one every `interval` tokens."""

    count: int
    interval: int


class StateSnapshots:
    """The snapshot pool. Eviction is a segmented LRU: snapshots nobody resumed from yet go first
    (least recently written first), then those a prefix hit used (least recently used first). A
    junction counts as used, since a second request reached it. So a sequence's own boundaries
    (its unique suffix, its decoded tokens) never push out a shared system prompt's state."""

    def __init__(self, first_slot: int, plan: SnapshotPlan, block_size: int):
        if plan.interval % block_size:
            raise ValueError(f"mamba_block_size {plan.interval} must be a multiple of block_size {block_size}")
        self.interval, self.block_size = plan.interval, block_size
        self._free: deque[int] = deque(range(first_slot, first_slot + plan.count))
        self._unused: OrderedDict[BlockKey, int] = OrderedDict()  # key -> slot, written, not resumed from
        self._used: OrderedDict[BlockKey, int] = OrderedDict()  # key -> slot, resumed from (or a junction)
        self._key_of: dict[int, BlockKey] = {}  # slot -> key, ready or being written
        self._junctions: set[int] = set()  # slots being written at a junction
        self.saved = 0  # snapshots written (steps that ran)
        self.restored = 0  # admitted prefix hits that resumed from one

    @property
    def num_slots(self) -> int:
        return len(self._free) + len(self._key_of)

    @property
    def ready(self) -> dict[BlockKey, int]:
        """Snapshots a prefix hit can resume from: key -> slot."""
        return {**self._unused, **self._used}

    def resume_point(self, seq: Sequence, hit_blocks: int) -> int:
        """Blocks of a `hit_blocks`-block prefix hit (its keys in seq.block_keys) the state can resume
        after: the longest with a ready snapshot; sets `seq.restore_from` to its slot (-1: none)."""
        seq.restore_from = -1
        for blocks in range(hit_blocks, 0, -1):
            slot = self.ready.get(seq.block_keys[blocks - 1])
            if slot is not None:
                seq.restore_from = slot
                return blocks
        return 0

    def mark_restored(self, slot: int) -> None:
        """An admitted sequence resumes from `slot` (its copy queued): the snapshot is used, evicted
        last (unless this step's schedule evicted it already: the copy reads it before it is rewritten)."""
        key = self._key_of.get(slot)
        if key in self._unused:
            self._used[key] = self._unused.pop(key)
        elif key in self._used:
            self._used.move_to_end(key)
        self.restored += 1

    def being_written(self, keys: list[BlockKey]) -> bool:
        """Whether the step being scheduled writes a snapshot of one of these prefixes."""
        pending = set(self._key_of.values()) - self._unused.keys() - self._used.keys()
        return not pending.isdisjoint(keys)

    def plan(self, seq: Sequence, num_tokens: int) -> None:
        """The snapshots `seq`'s next step (tokens num_computed_tokens..num_tokens) writes, in
        `seq.state_snapshots` as (boundary, slot): its junction, and the last interval boundary."""
        self._drop_unwritten(seq)
        start, end = seq.num_computed_tokens, min(num_tokens, len(seq.token_ids))
        last = end - end % self.interval
        boundaries = [last] if last > start else []
        junction = seq.snapshot_junction if start < seq.snapshot_junction <= end else None
        if junction is not None and junction not in boundaries:
            boundaries.append(junction)
        if not boundaries:
            return
        bs = self.block_size
        keys = _chain_keys(seq, max(boundaries) // bs, bs)
        for boundary in sorted(boundaries):
            key = keys[boundary // bs - 1]
            if key in self._unused or key in self._used or key in self._key_of.values():
                continue  # another sequence holds (or is writing) this prefix's state
            slot = self._take()
            if slot is None:
                break  # every slot is being written this step
            self._key_of[slot] = key
            if boundary == junction:
                self._junctions.add(slot)
            seq.state_snapshots.append((boundary, slot))

    def promote(self, seq: Sequence) -> None:
        """`seq`'s step ran: the snapshots it wrote up to its computed tokens can be looked up."""
        written = [(b, slot) for b, slot in seq.state_snapshots if b <= seq.num_computed_tokens]
        for _, slot in written:
            segment = self._used if slot in self._junctions else self._unused
            segment[self._key_of[slot]] = slot
            self._junctions.discard(slot)
            self.saved += 1
        seq.state_snapshots = [s for s in seq.state_snapshots if s not in written]

    def release(self, seq: Sequence) -> None:
        """`seq` is freed: snapshots it was to write are given up, and a restore it had not started."""
        self._drop_unwritten(seq)
        seq.restore_from, seq.snapshot_junction = -1, 0

    def reset(self) -> None:
        """Forget every ready snapshot (the prefix cache was reset)."""
        for slot in self.ready.values():
            del self._key_of[slot]
            self._free.append(slot)
        self._unused.clear()
        self._used.clear()

    def _drop_unwritten(self, seq: Sequence) -> None:
        for _, slot in seq.state_snapshots:
            del self._key_of[slot]
            self._junctions.discard(slot)
            self._free.append(slot)
        seq.state_snapshots = []

    def _take(self) -> int | None:
        """A free slot, or the first to evict; None when every slot is being written."""
        if self._free:
            return self._free.popleft()
        for segment in (self._unused, self._used):
            if segment:
                _, slot = segment.popitem(last=False)
                del self._key_of[slot]
                return slot
        return None


def _chain_keys(seq: Sequence, num_blocks: int, block_size: int) -> list[BlockKey]:
    """The prefix-cache keys of `seq`'s first `num_blocks` blocks: its registered ones, extended."""
    keys = list(seq.block_keys[:num_blocks])
    for index in range(len(keys), num_blocks):
        tokens = seq.token_ids[index * block_size : (index + 1) * block_size]
        keys.append(chained_key(keys[index - 1] if index else None, tokens))
    return keys
