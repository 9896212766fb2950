"""Block manager and scheduler invariants under random workloads (hypothesis): allocation,
chunked prefill, preemption, prefix-cache hits and eviction, forks with copy-on-write. A model of
the KV cache (which token each physical slot holds) checks that every sequence reads back its own
tokens from its pages, whatever is shared or copied."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedbench.engine.block_manager import BlockManager, blocks_needed
from pagedbench.engine.prefix_cache import chained_key
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.sequence import Sequence, SequenceStatus
from pagedbench.engine.state_snapshots import SnapshotPlan
from pagedbench.sample.sampling_params import SamplingParams


def free_list(bm: BlockManager) -> list[int]:
    """The pool's free pages: fresh ones, then the prefix cache's evictable ones."""
    return [*bm.pool.fresh, *bm.prefix_cache.evictable]


def check_invariants(bm: BlockManager, sched: Scheduler, live: list[Sequence]) -> None:
    held = Counter(b for s in live for b in s.block_table)
    assert all(bm.pool.ref_counts[b] == held.get(b, 0) for b in range(bm.num_blocks)), "ref counts disagree with tables"
    free = free_list(bm)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert set(free) == {b for b in range(bm.num_blocks) if bm.pool.ref_counts[b] == 0}, "free list != unreferenced"
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        assert len(s.block_table) >= blocks_needed(s.num_computed_tokens, bm.block_size)
        for n in (1, 2, bm.block_size + 1):  # the scheduler's fast path skips allocate only when it has nothing to do
            if bm.fits_in_place(s, s.num_computed_tokens + n):
                assert bm.num_new_blocks(s, s.num_computed_tokens + n) == 0
                assert bm.can_allocate(s, s.num_computed_tokens + n)
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
    for s in sched.swapped:
        assert s.status is SequenceStatus.SWAPPED and not s.block_table
        assert len(s.cpu_block_table) == blocks_needed(s.num_computed_tokens, bm.block_size)
    # Prefix cache: a registered block holds exactly the tokens of its key, in every sequence reading it,
    # and an unreferenced registered block is evictable (free, content kept).
    for s in live:
        for i, key in enumerate(s.block_keys):
            assert key[1] == tuple(s.token_ids[i * bm.block_size : (i + 1) * bm.block_size])
            block = s.block_table[i]
            assert bm.prefix_cache.key_of.get(block, key)[1] == key[1], (
                "a shared block's content differs between readers"
            )
    for block, key in bm.prefix_cache.key_of.items():
        assert bm.prefix_cache.cached[key] == block
        assert (bm.pool.ref_counts[block] == 0) == (block in bm.prefix_cache.evictable)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_len = draw(st.integers(1, 64))
    num_blocks = blocks_needed(max_len, block_size) + draw(st.integers(0, 12))
    # (prompt length, max_tokens, arrival step, samples forked after the prompt, shared-prefix family)
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(1, max_len), st.integers(1, 20), st.integers(0, 6), st.integers(1, 3), st.integers(0, 2)
            ),
            min_size=1,
            max_size=12,
        )
    )
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    swap_blocks = draw(st.sampled_from([None, 0, 3, 40]))  # None: recompute; else swap with that many CPU blocks
    limits = draw(st.integers(1, 40)), draw(st.integers(3, 8))
    spec_k = draw(st.sampled_from([0, 0, 1, 3]))  # speculated tokens per decoding step (0: none)
    return block_size, max_len, num_blocks, *limits, requests, policy, swap_blocks, spec_k


class KVModel:
    """Which token each (block, slot) holds: written as the scheduler's steps compute tokens,
    copied block to block as the block manager's copy-on-write pairs say (before the step)."""

    def __init__(self, block_size: int):
        self.block_size, self.slots = block_size, {}

    def run_step(self, bm: BlockManager, out) -> None:
        """The engine's order: swap-outs, copy-on-write copies, swap-ins, then the step's writes."""
        swap_out, swap_in = bm.take_swaps()
        self._copy(swap_out, "cpu", src_device=True)
        self._copy(bm.take_copies(), None)
        self._copy(swap_in, None, src_device=False)
        for seq, n in zip(out.seqs, out.num_tokens):
            tokens = seq.token_ids + seq.spec_token_ids  # a verifying sequence writes its proposals' K/V too
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[pos // self.block_size]
                self.slots[block, pos % self.block_size] = tokens[pos]

    def _copy(self, pairs, dst_space, src_device=True) -> None:
        """Copy whole blocks; swap space is keyed ("cpu", block), device blocks by their number."""
        src_key = (lambda b: b) if src_device else (lambda b: ("cpu", b))
        dst_key = (lambda b: ("cpu", b)) if dst_space == "cpu" else (lambda b: b)
        content = {dst: [self.slots.get((src_key(src), i)) for i in range(self.block_size)] for src, dst in pairs}
        for dst, values in content.items():
            self.slots.update({(dst_key(dst), i): t for i, t in enumerate(values)})

    def check(self, seq: Sequence) -> None:
        bs = self.block_size
        if seq.status is SequenceStatus.SWAPPED:
            read = [
                self.slots.get((("cpu", seq.cpu_block_table[p // bs]), p % bs)) for p in range(seq.num_computed_tokens)
            ]
        else:
            read = [self.slots.get((seq.block_table[p // bs], p % bs)) for p in range(seq.num_computed_tokens)]
        assert read == seq.token_ids[: seq.num_computed_tokens], f"sequence {seq.request_id} reads wrong K/V"


def run_workload(workload) -> Counter:
    """One generated workload through the scheduler and block manager, every invariant checked after
    every step; returns what it exercised (operations, swaps, rejected verifications)."""
    block_size, max_len, num_blocks, budget, max_seqs, requests, policy, swap_blocks, spec_k = workload
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=swap_blocks or 0)
    sched = Scheduler(bm, max_seqs, budget, policy, "recompute" if swap_blocks is None else "swap")
    if spec_k:  # as engine/speculator.py: k proposals, fewer near max_tokens or max_len
        sched.lookahead = lambda s: (
            0
            if s.num_output_tokens == 0
            else max(0, min(spec_k, max_len - s.num_tokens - 1, s.params.max_tokens - s.num_output_tokens - 1))
        )
    kv = KVModel(block_size)
    live: list[Sequence] = []
    pending = list(enumerate(requests))
    operations = swaps = verifies = 0
    for step in range(10_000):
        while pending and pending[0][1][2] <= step:
            i, (prompt_len, max_tokens, _, width, family) = pending.pop(0)
            prompt = [family * 100 + t for t in range(prompt_len)]  # requests of one family share prefixes
            params = SamplingParams(max_tokens=max_tokens, n=width)
            seq = Sequence(str(i), None, prompt, params)
            seq.arrival_time = float(i)
            seq.priority = (prompt_len * 7 + i) % 3  # arbitrary, ties included
            sched.add(seq)
            live.append(seq)
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        operations += len(out.seqs) + out.num_preempted
        assert sum(out.num_tokens) <= budget and len(sched.running) <= max_seqs
        assert len({id(s) for s in out.seqs}) == len(out.seqs), "a sequence scheduled twice"
        assert all(s.status is SequenceStatus.RUNNING for s in out.seqs)
        ones = [n == 1 for n in out.num_tokens]
        assert ones == sorted(ones, reverse=True), "decodes must come first"
        if sched.has_unfinished():
            assert not out.empty, "scheduler stalled with work left"
        assert all(1 <= n <= s.num_uncomputed_tokens + spec_k for s, n in zip(out.seqs, out.num_tokens))
        # Verifying sequences propose m tokens (the first `accepted` right, the rest wrong), write their K/V
        # and count only the accepted ones and the target's own as computed; the rest's pages go back.
        accepted = {}
        for s, n in zip(out.seqs, out.num_tokens):
            if n > 1 and s.num_uncomputed_tokens == 1:
                accepted[id(s)] = (step + int(s.request_id) + s.index) % n  # 0..m
                s.spec_token_ids = [7 * s.index + s.num_tokens + j if j < accepted[id(s)] else -1 for j in range(n - 1)]
        verifies += sum(accepted.get(id(s), 0) < n - 1 for s, n in zip(out.seqs, out.num_tokens) if id(s) in accepted)
        kv.run_step(bm, out)
        out.num_tokens = [1 + accepted[id(s)] if id(s) in accepted else n for s, n in zip(out.seqs, out.num_tokens)]
        sched.step_update.computed(out)  # registers newly full blocks in the prefix cache
        for s in list(out.seqs):
            if id(s) in accepted:
                bm.trim(s)
                assert len(s.block_table) == blocks_needed(s.num_computed_tokens, block_size), "rejected pages kept"
                s.spec_token_ids = []
                operations += 1
                for _ in range(accepted[id(s)] + 1):  # the accepted proposals, then the target's token
                    s.token_ids.append(7 * s.index + len(s.token_ids))
                    if s.num_output_tokens >= s.params.max_tokens or s.num_tokens >= max_len:
                        sched.finish(s, "length")
                        live.remove(s)
                        break
                continue
            assert len(s.block_table) >= blocks_needed(s.num_computed_tokens, block_size)
            if s.num_computed_tokens == s.num_tokens:  # the prompt is done: a token is sampled
                samples = [s]
                if not s.forked:  # the first token: fork into the request's samples (shared pages)
                    samples += [sched.step_update.fork(s, index) for index in range(1, s.params.width)]
                    live += samples[1:]
                    operations += len(samples) - 1
                for sample in samples:
                    sample.token_ids.append(7 * sample.index + len(sample.token_ids))  # each its own tokens
                    if sample.num_output_tokens >= sample.params.max_tokens or sample.num_tokens >= max_len:
                        sched.finish(sample, "length")
                        live.remove(sample)
                        operations += 1
        check_invariants(bm, sched, live)
        for s in [*sched.running, *sched.swapped]:
            kv.check(s)
        swapped_cpu = [b for s in sched.swapped for b in s.cpu_block_table]
        cpu_pool = swapped_cpu + list(bm.swap_space.free) + bm.swap_space.releasing
        assert sorted(cpu_pool) == list(range(bm.num_cpu_blocks)), "swap space leaked or double-used"
        swaps += sched.num_swap_outs - swaps
    else:
        raise AssertionError("workload did not finish")
    assert bm.num_free_blocks == num_blocks and not any(bm.pool.ref_counts), "blocks leaked"
    return Counter(operations=operations, swaps=swaps, verifies=verifies)


def test_scheduler_and_block_manager_invariants():
    """150 generated workloads, each checked after every step (run_workload); together they come
    to more than 10k scheduler and block operations, with swaps to CPU and speculative
    verifications that rejected proposals among them: counted here, by this test's own run."""
    totals = Counter()

    # derandomized: the same 150 workloads every run, so the total below is a fact, not a draw (a random
    # draw once came to 9,576 operations)
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(workloads())
    def each(workload):
        totals.update(run_workload(workload))

    each()
    assert totals["operations"] > 10_000, totals
    assert totals["swaps"] > 0, "no workload swapped"
    assert totals["verifies"] > 0, "no verification rejected a proposal"


def test_preemption_frees_newest_first_and_recomputes():
    bm = BlockManager(num_blocks=4, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = (Sequence(str(i), None, [1 + i, 2, 3, 4], SamplingParams()) for i in range(2))  # no shared prefix
    new.arrival_time = old.arrival_time + 1
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert out.seqs == [old, new] and bm.num_free_blocks == 0
    for s in (old, new):
        s.num_computed_tokens = 4
        s.token_ids.append(9)
    out = sched.schedule()  # old needs a third block: the newest sequence makes room
    assert out.seqs == [old] and out.num_preempted == 1
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
    assert list(sched.waiting) == [new] and new.num_preemptions == 1


def test_a_prefix_is_shared_by_requests_admitted_in_the_same_step():
    """vLLM v1's rule: an admitted prompt's full pages are registered as they are scheduled."""
    bm = BlockManager(num_blocks=8, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = (Sequence(str(i), None, [1, 2, 3, 4, 5 + i], SamplingParams()) for i in range(2))
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert dict(zip(out.seqs, out.num_tokens)) == {first: 5, second: 1}  # second computes its last token only
    assert second.block_table[:2] == first.block_table[:2] and bm.num_shared_blocks == 2 and bm.prefix_cache.hits == 4


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence("a", None, [1], SamplingParams())
    bm.allocate(seq, 1)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match=f"double free of block {table[0]}"):
        bm.free(seq)
    assert bm.num_free_blocks == 2  # nothing freed twice


class BlockManagerMachine(RuleBasedStateMachine):
    """The block manager driven directly: allocate (admission with prefix-cache hits), append
    (compute tokens into pages, copy-on-write included), fork, free, preempt, evict (by
    allocating under pressure) and reset, checked after every operation against a model of the
    page contents and the reference counts."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.kv = KVModel(2)
        self.seqs: list[Sequence] = []
        self.ids = 0

    def _compute(self, seq: Sequence, n: int) -> bool:
        if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            return False
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        self.kv.run_step(self.bm, SchedulerOutput([seq], [n]))
        seq.num_computed_tokens += n
        self.bm.cache_computed_blocks(seq)
        return True

    @rule(family=st.integers(0, 2), length=st.integers(1, 9))
    def admit(self, family, length):
        seq = Sequence(str(self.ids), None, [family * 50 + t for t in range(length)], SamplingParams())
        self.ids += 1
        self.bm.match_prefix(seq)
        if self._compute(seq, seq.num_uncomputed_tokens):
            self.seqs.append(seq)
        else:
            self.bm.free(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.seqs))
        seq.token_ids += [seq.num_tokens * 3 + seq.index + i for i in range(n)]
        if not self._compute(seq, n):
            del seq.token_ids[-n:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = parent.fork(parent.index + 1)
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        self.seqs.remove(seq)
        if preempt:  # recompute from scratch, hitting whatever the cache still holds
            seq.num_computed_tokens = 0
            self.bm.match_prefix(seq)
            if self._compute(seq, seq.num_uncomputed_tokens):
                self.seqs.append(seq)
            else:
                self.bm.free(seq)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        bm = self.bm
        held = Counter(b for s in self.seqs for b in s.block_table)
        assert all(bm.pool.ref_counts[b] == held.get(b, 0) for b in range(bm.num_blocks)), "ref counts disagree"
        free = free_list(bm)
        assert len(free) == len(set(free)) and set(free) == {b for b, n in enumerate(bm.pool.ref_counts) if not n}
        assert bm.num_shared_blocks == sum(count > 1 for count in bm.pool.ref_counts)
        for seq in self.seqs:
            self.kv.check(seq)
        for block, key in bm.prefix_cache.key_of.items():  # a cached page holds exactly its key's tokens
            assert [self.kv.slots.get((block, i)) for i in range(bm.block_size)] == list(key[1])


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase


class HybridBlockManagerMachine(BlockManagerMachine):
    """The same operations for a hybrid model, whose sequences also hold a DeltaNet state slot:
    a sequence holds one slot exactly while it holds pages, a fork's slot is queued to copy its
    parent's, admission waits when no slot is free, and no slot is ever lost or shared."""

    SLOTS = 4

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2, num_state_slots=self.SLOTS)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = parent.fork(parent.index + 1)
        if not self.bm.state_slots.num_free:
            with pytest.raises(RuntimeError, match="state slots"):
                self.bm.fork(parent, child)
            assert not child.block_table and child.state_slot < 0  # refused before taking anything
            return
        self.bm.fork(parent, child)
        assert self.bm.take_state_copies() == [(parent.state_slot, child.state_slot)]
        self.seqs.append(child)

    @invariant()
    def slots_follow_the_pages(self):
        held = [s.state_slot for s in self.seqs]
        assert all(slot >= 0 for slot in held) and len(held) == len(set(held)), "a live sequence without its own slot"
        assert self.bm.state_slots.num_free + len(held) == self.SLOTS, "a slot lost or counted twice"


HybridBlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
test_hybrid_state_slots_state_machine = HybridBlockManagerMachine.TestCase


class HybridPrefixCachingMachine(HybridBlockManagerMachine):
    """Hybrid prefix caching: a prefix hit resumes from a DeltaNet state snapshot. A model of the
    state tensors records, per slot, the tokens whose state it holds (a step's run writes its
    sequences' slots and the snapshots it was given; queued copies run first, as the engine runs
    them). Checked after every operation: a sequence about to continue finds exactly its computed
    tokens' state in its slot, a ready snapshot holds the state of the prefix its key names, and
    the snapshot slots are never lost, shared with a running slot, or counted twice."""

    SNAPSHOTS, INTERVAL = 3, 4  # every 2 pages of 2

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, 2, num_state_slots=self.SLOTS, state_snapshots=SnapshotPlan(3, self.INTERVAL))
        self.state: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its state has seen

    def _compute(self, seq: Sequence, n: int) -> bool:
        if not self._schedule(seq, n):
            return False
        self._run([seq], [n])
        return True

    def _schedule(self, seq: Sequence, n: int) -> bool:
        """As the scheduler: allocate, and register the pages the step will write (so that a request
        admitted in the same step shares them, while the state snapshots are not written yet)."""
        if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            return False
        self.bm.allocate(seq, seq.num_computed_tokens + n)
        self.bm.cache_computed_blocks(seq, seq.num_computed_tokens + n)
        return True

    def _run(self, seqs: list[Sequence], ns: list[int]) -> None:
        for src, dst in self.bm.take_state_copies():
            self.state[dst] = self.state[src]
        for seq, n in zip(seqs, ns):
            start = seq.num_computed_tokens
            assert self.state.get(seq.state_slot, ()) == tuple(seq.token_ids[:start]) or not start, "resumed wrongly"
            for boundary, snapshot in seq.state_snapshots:
                assert start < boundary <= start + n
                assert boundary % self.INTERVAL == 0 or boundary == seq.snapshot_junction
                self.state[snapshot] = tuple(seq.token_ids[:boundary])
            self.state[seq.state_slot] = tuple(seq.token_ids[: start + n])
        self.kv.run_step(self.bm, SchedulerOutput(seqs, ns))
        for seq, n in zip(seqs, ns):
            seq.num_computed_tokens += n
            self.bm.cache_computed_blocks(seq)

    @rule(family=st.integers(0, 2), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=3))
    def admit_together(self, family, lengths):
        """Requests of one family admitted in one step: later ones share the first's pages, not its
        snapshots (written by the step), and each resumes only from a snapshot written before."""
        batch = []
        for length in lengths:
            seq = Sequence(str(self.ids), None, [family * 50 + t for t in range(length)], SamplingParams())
            self.ids += 1
            self.bm.match_prefix(seq)
            if not self._schedule(seq, seq.num_uncomputed_tokens):
                self.bm.free(seq)
                break
            batch.append(seq)
        if batch:
            self._run(batch, [s.num_uncomputed_tokens for s in batch])
            self.seqs += batch

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        if self.bm.state_slots.num_free:
            child = parent.fork(parent.index + 1)
            self.bm.fork(parent, child)
            for src, dst in self.bm.take_state_copies():
                self.state[dst] = self.state[src]
            self.seqs.append(child)

    @invariant()
    def snapshots_hold_their_prefixes(self):
        snaps = self.bm.snapshots
        for key, slot in snaps.ready.items():
            assert slot >= self.SLOTS, "a snapshot in a running sequence's slot"
            prefix, chain = self.state[slot], None
            for i in range(0, len(prefix), 2):
                chain = chained_key(chain, prefix[i : i + 2])
            assert chain == key, "a snapshot holds another prefix's state"
        assert snaps.num_slots == self.SNAPSHOTS and len(set(snaps.ready.values())) == len(snaps.ready)


HybridPrefixCachingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
test_hybrid_prefix_caching_state_machine = HybridPrefixCachingMachine.TestCase


def test_pages_released_behind_a_window_are_never_cached_after_a_swap():
    """A windowed sequence swapped out and back in comes back with NO_BLOCK entries for the pages
    its window released; registering its computed blocks again must skip them, so a later request
    with the same prefix gets no hit on a page that holds nothing."""
    from pagedbench.engine.block_manager import NO_BLOCK

    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=8, sliding_window=4)
    prompt = list(range(1, 17))  # 4 full pages
    seq = Sequence("0", None, prompt, SamplingParams())
    bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.cache_computed_blocks(seq)
    bm.release_out_of_window(seq)
    assert seq.block_table[:2] == [NO_BLOCK, NO_BLOCK]
    bm.swap_out(seq)
    bm.take_swaps()
    bm.swap_in(seq)
    bm.take_swaps()
    assert seq.block_table[:2] == [NO_BLOCK, NO_BLOCK]
    bm.reset_prefix_cache()  # the released pages' old copies evicted: nothing holds their keys
    bm.cache_computed_blocks(seq)  # registers the held pages again, never a NO_BLOCK entry
    assert NO_BLOCK not in bm.prefix_cache.key_of
    same = Sequence("1", None, prompt, SamplingParams())
    assert bm.match_prefix(same) == 0  # its first page is cached nowhere: no prefix to share
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
