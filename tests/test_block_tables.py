"""The worker's persistent block table (worker/step_batch.py BlockTables): random workloads through
the real Scheduler and BlockManager (prefix caching, forks, preemption by recompute and by swap, a
sliding window, speculative trims), and every step's batch laid out from it equals the one laid out
by copying every sequence's whole page list."""

import random

import numpy as np
import pytest

from pagedbench.engine.block_manager import BlockManager, blocks_needed
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.step_batch import BlockTables, StepBatch, step_batch


def full_copy(seqs: list[Sequence], max_blocks: int, num_cache_blocks: int) -> np.ndarray:
    """The old layout: each page list copied whole, released pages (-1) on the padding page."""
    table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        pages = s.block_table[:max_blocks]
        table[i, : len(pages)] = pages
    table[table < 0] = num_cache_blocks - 1
    return table


def assert_same_batch(kept: StepBatch, copied: StepBatch, tables: BlockTables) -> None:
    for name in StepBatch.__slots__:
        a, b = getattr(kept, name), getattr(copied, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        else:
            assert a == b, name
    assert not np.shares_memory(kept.block_table, tables.table), "a step's block table must be its own array"


def run_workload(seed: int, swap: bool, window: int | None, spec_k: int) -> int:
    """One seeded workload; every step's batch compared (assert_same_batch). Returns the steps run."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_len = rng.randint(4, 40)
    num_blocks = blocks_needed(max_len, block_size) + rng.randint(0, 10)
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=40 if swap else 0, sliding_window=window)
    sched = Scheduler(bm, rng.randint(3, 6), rng.randint(4, 32), preemption_mode="swap" if swap else "recompute")
    if spec_k:
        sched.lookahead = lambda s: (  # as engine/speculator.py: fewer near max_tokens or max_len
            0
            if s.num_output_tokens == 0
            else max(0, min(spec_k, max_len - s.num_tokens - 1, s.params.max_tokens - s.num_output_tokens - 1))
        )
    tables, num_cache_blocks = BlockTables(rows=2, width=1), num_blocks + 1  # tiny: rows and columns grow
    for i in range(rng.randint(1, 10)):
        family, prompt_len = rng.randint(0, 2), rng.randint(1, max_len - 1)
        params = SamplingParams(max_tokens=rng.randint(1, 16), n=rng.randint(1, 3))
        sched.add(Sequence(str(i), None, [family * 100 + t for t in range(prompt_len)], params))
    for step in range(2_000):
        if not sched.has_unfinished():
            return step
        out = sched.schedule()
        verifying = [s for s, n in zip(out.seqs, out.num_tokens) if n > 1 and s.num_uncomputed_tokens == 1]
        for s, n in zip(out.seqs, out.num_tokens):
            s.spec_token_ids = [rng.randint(0, 99) for _ in range(n - 1)] if s in verifying else []
        kept = step_batch(out.seqs, out.num_tokens, block_size, num_cache_blocks, tables)
        copied = step_batch(out.seqs, out.num_tokens, block_size, num_cache_blocks)
        assert_same_batch(kept, copied, tables)
        assert np.array_equal(kept.block_table, full_copy(out.seqs, kept.block_table.shape[1], num_cache_blocks))
        rejected = {id(s): rng.randint(0, len(s.spec_token_ids)) for s in verifying}
        bm.take_swaps(), bm.take_copies()
        sched.step_update.computed(out, rejected)
        for s in list(out.seqs):
            accepted = len(s.spec_token_ids) - rejected.get(id(s), 0)
            s.spec_token_ids = []
            if id(s) in rejected:
                bm.trim(s)
            elif s.num_computed_tokens < s.num_tokens:
                continue
            samples = [s]
            if not s.forked:  # the first token: the request's other samples share its pages
                samples += [sched.step_update.fork(s, index) for index in range(1, s.params.width)]
            for sample in samples:
                for _ in range(accepted + 1 if sample is s else 1):
                    sample.token_ids.append(rng.randint(0, 99))
                    if sample.num_output_tokens >= sample.params.max_tokens or sample.num_tokens >= max_len:
                        sched.finish(sample, "length")
                        break
    raise AssertionError("workload did not finish")


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("spec_k", [0, 2])
def test_kept_block_table_lays_out_every_step_as_a_full_copy(swap, window, spec_k):
    steps = sum(run_workload(seed, swap, window, spec_k) for seed in range(25))
    assert steps > 200


def test_rows_of_sequences_gone_are_reused():
    """Rows stay bounded under churn (a sequence leaves and one arrives every step): those of the
    sequences a step does not run are taken by new ones."""
    tables, running = BlockTables(rows=2, width=4), []
    for step in range(200):
        seq = Sequence(str(step), None, [1, 2], SamplingParams())
        seq.block_table = [step, step + 1]
        running = [*running[-5:], seq]  # six at most
        for s in running:
            s.block_table.append(s.block_table[-1] + 1)
        expected = full_copy(running, 8, num_cache_blocks=1_000)
        assert np.array_equal(tables.gather(running, 8), expected)
    assert len(tables.owner) <= 16 and len(tables.row_of) <= 16
