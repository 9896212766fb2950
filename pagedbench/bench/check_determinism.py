"""`pagedbench check --determinism`: whether a backend's output can be trusted bitwise.

Per backend, dtype, phase (decode, prefill, mixed) and variant the backend runs:
- deterministic: the same plan() + forward() twice on the same batch gives bitwise-equal outputs;
- batch invariant: a few probe sequences' outputs alone (a batch of 1) equal, bitwise, theirs on
  other page placements (the same pages shuffled to other physical blocks) and inside batches of
  other sizes (with other sequences, on other placements). What broke it is named: "placement" when
  a batch of 1 moved changes, "batch size" when a larger batch does.
A backend states its invariance as class data (`batch_invariant_reason`, None: invariant); a row fails
when the backend is not deterministic, or claims invariance and is not invariant.
"""

import random

import torch

from pagedbench.backends.base import PLAIN, AttentionVariant, one_line
from pagedbench.backends.registry import resolve
from pagedbench.bench.check import HEADS, LATENT_CONFIGS, SINKS_ONLY, attend
from pagedbench.bench.problems import AttentionProblem, place, random_problem
from pagedbench.device.dtypes import dtype_name

PHASES = ("decode", "prefill", "mixed")
# check's variant kinds, one each: a window shorter than most contexts, Gemma 2's cap, gpt-oss's
# sinks, and DeepSeek's latent attention (at its 16-head TP shard, pages of 64).
VARIANTS = {
    "plain": PLAIN,
    "window": AttentionVariant(sliding_window=37),
    "soft-cap": AttentionVariant(softcap=30.0),
    "sinks": SINKS_ONLY,
    "latent": LATENT_CONFIGS[0]["variant"],
}
BATCH_SIZES = {"cpu": (1, 7, 64), "cuda": (1, 7, 64, 256)}
PROBES = 3  # sequences followed through every batch
PLACEMENTS = (1, 2)  # layout seeds a batch of one is moved to (its first placement is seed 0)
COLUMNS = ["backend", "dtype", "phase", "variant", "deterministic", "max_abs_diff_repeat", "batch_invariant"]
COLUMNS += ["max_abs_diff_batch", "broken_by", "claimed_invariant", "reason", "status"]


def shape_of(variant_name: str) -> dict:
    """num_heads, num_kv_heads, head_dim and block_size of a variant's problems: GQA-4 of 64 in pages
    of 16, latent attention at check's MLA-16 configuration."""
    if variant_name == "latent":
        config = LATENT_CONFIGS[0]
        num_heads, num_kv_heads = HEADS[config["heads"]]
        return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=config["head_dim"], block_size=64)
    num_heads, num_kv_heads = HEADS["GQA-4"]
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=16)


def pool_seqs(phase: str, count: int, block_size: int, seed: int = 0) -> list[tuple[int, int]]:
    """`count` (context_len, query_len) pairs of a phase, decodes first: one-token decodes over up to
    six pages, prefills of up to three pages, or half of each with chunked prefills among them."""
    rng = random.Random(seed)
    p = block_size

    def decode():
        return rng.randint(1, 6 * p), 1

    def chunk():
        return rng.choice((0, rng.randint(1, 3 * p))), rng.randint(2, 3 * p)

    if phase == "decode":
        return [decode() for _ in range(count)]
    if phase == "prefill":
        return [(0, rng.randint(1, 3 * p)) for _ in range(count)]
    if phase == "mixed":
        return [decode() for _ in range(count // 2)] + [chunk() for _ in range(count - count // 2)]
    raise ValueError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")


def subset(problem: AttentionProblem, indices: list[int]) -> AttentionProblem:
    """The problem of sequences `indices` alone (in that order)."""
    starts = [0]
    for _, q in problem.seqs:
        starts.append(starts[-1] + q)
    q = torch.cat([problem.q[starts[i] : starts[i + 1]] for i in indices])
    k, v = [problem.k[i] for i in indices], [problem.v[i] for i in indices]
    return AttentionProblem([problem.seqs[i] for i in indices], q, k, v, value_dim=problem.value_dim)


def probe_indices(count: int) -> list[int]:
    """The probe sequences: the first, one in the middle (the first prefill of a mixed pool), the last."""
    return sorted({0, count // 2, count - 1})[:PROBES]


def batches_of(size: int, count: int, probes: list[int], seed: int) -> list[list[int]]:
    """Batches of `size` sequences of the pool holding every probe once: the probes in groups, each
    among others drawn at random, in pool order (decodes first)."""
    rng = random.Random(seed)
    per = min(size, len(probes))
    batches = []
    for g in range(0, len(probes), per):
        group = probes[g : g + per]
        others = rng.sample([i for i in range(count) if i not in group], size - len(group))
        batches.append(sorted(group + others))
    return batches


class Runner:
    """One backend instance (the engine's: one lives across steps) attending batches of a pool."""

    def __init__(self, backend, problem: AttentionProblem, block_size: int, device, sinks):
        self.backend, self.problem, self.block_size, self.device, self.sinks = (
            backend,
            problem,
            block_size,
            device,
            sinks,
        )
        self.rows = [0]
        for _, q in problem.seqs:
            self.rows.append(self.rows[-1] + q)

    def outputs(self, indices: list[int], layout_seed: int) -> dict[int, torch.Tensor]:
        """Each sequence's output rows in a batch of `indices` placed with `layout_seed`."""
        batch = place(subset(self.problem, indices), self.block_size, self.device, layout_seed, 3 + layout_seed)
        out = attend(self.backend, batch, self.sinks)
        starts = [0]
        for i in indices:
            starts.append(starts[-1] + self.rows[i + 1] - self.rows[i])
        return {i: out[starts[n] : starts[n + 1]] for n, i in enumerate(indices)}

    def repeat_diff(self, indices: list[int]) -> float:
        """Max |Δ| between the same plan() + forward() twice on one batch (0.0: bitwise equal)."""
        batch = place(subset(self.problem, indices), self.block_size, self.device, 0, 3)
        first, second = attend(self.backend, batch, self.sinks), attend(self.backend, batch, self.sinks)
        return difference(first, second)


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when bitwise equal (NaNs where the other has them too), else the max |Δ| (inf: a NaN differs)."""
    if torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return 0.0
    diff = (a.double() - b.double()).abs()
    return float(diff.nan_to_num(nan=float("inf")).max())


def invariance(runner: Runner, count: int, batch_sizes: tuple[int, ...]) -> tuple[float, dict[str, list[str]]]:
    """(max |Δ| of the probes against themselves alone, {dimension: where it broke})."""
    probes = probe_indices(count)
    alone = {i: runner.outputs([i], 0)[i] for i in probes}
    worst, broken = 0.0, {}
    for seed in PLACEMENTS:
        for i in probes:
            diff = difference(alone[i], runner.outputs([i], seed)[i])
            if diff:
                broken.setdefault("placement", []).append(f"placement {seed}")
            worst = max(worst, diff)
    for size in batch_sizes:
        if size == 1:
            continue
        for batch in batches_of(min(size, count), count, probes, seed=size):
            outs = runner.outputs(batch, layout_seed=size)
            diff = max(difference(alone[i], outs[i]) for i in probes if i in outs)
            if diff:
                broken.setdefault("batch size", []).append(f"batch size {size}")
            worst = max(worst, diff)
    return worst, {k: list(dict.fromkeys(v)) for k, v in broken.items()}


def determinism_row(name, device, dtype, phase, variant_name, batch_sizes, batch_invariant=False) -> dict:
    """One row: `name` on one dtype, phase and variant (skipped with the backend's reason), in its
    batch-invariant form with `batch_invariant` (skipped where it has none)."""
    variant, shape = VARIANTS[variant_name], shape_of(variant_name)
    head_dim, block_size = shape["head_dim"], shape["block_size"]
    found = resolve(name, device, dtype, head_dim, block_size, num_heads=shape["num_heads"],
                    num_kv_heads=shape["num_kv_heads"], **variant.settings())  # fmt: skip
    row = {"backend": name, "provider": found.provider, "dtype": dtype_name(dtype), "phase": phase}
    row["variant"] = variant_name
    claim = found.cls.batch_invariance(device, batch_invariant=batch_invariant, dtype=dtype, head_dim=head_dim,
                                       block_size=block_size, **variant.settings())  # fmt: skip
    row["claimed_invariant"] = claim is None
    if found.reason or (batch_invariant and claim):
        why = found.reason or f"refused under batch_invariant: {claim}"
        return row | {"status": "skipped", "reason": why}
    count = max(batch_sizes)
    seqs = pool_seqs(phase, count, block_size)
    problem = random_problem(seqs, shape["num_heads"], shape["num_kv_heads"], head_dim, dtype, seed=count,
                             value_dim=variant.value_dim)  # fmt: skip
    sinks = torch.randn(shape["num_heads"], generator=torch.Generator().manual_seed(7)) * 2 if variant.sinks else None
    try:
        extra = {} if variant == PLAIN else {"variant": variant}  # third-party backends may predate it
        extra |= {"batch_invariant": True} if batch_invariant else {}
        backend = found.cls(shape["num_heads"], shape["num_kv_heads"], head_dim, head_dim**-0.5, block_size,
                            device, dtype, **extra)  # fmt: skip
        runner = Runner(backend, problem, block_size, device, sinks)
        repeat = runner.repeat_diff(list(range(count)))
        worst, broken = invariance(runner, count, batch_sizes)
    except Exception as e:  # a backend that raises fails this row; the others go on
        return row | {"status": "fail", "reason": f"raised {one_line(e)}"}
    return row | verdict(repeat, worst, broken, claim)


def verdict(repeat: float, worst: float, broken: dict[str, list[str]], claim: str | None) -> dict:
    """The row's measured columns, its reason and its status."""
    why = []
    if repeat:
        why.append(f"not deterministic: the same call twice differs by {repeat:.3g}")
    if broken and claim is None:
        where = ", ".join(w for ws in broken.values() for w in ws)
        why.append(f"claims batch invariance but differs by {worst:.3g} ({where})")
    reason = "; ".join(why) or (claim or "")
    return {
        "deterministic": not repeat,
        "max_abs_diff_repeat": repeat,
        "batch_invariant": not broken,
        "max_abs_diff_batch": worst,
        "broken_by": ", ".join(sorted(broken)),
        "reason": reason,
        "status": "fail" if why else "pass",
    }


def run_determinism(
    backends: list[str],
    device: torch.device,
    dtypes: list[torch.dtype],
    phases: tuple[str, ...] = PHASES,
    variants: tuple[str, ...] = tuple(VARIANTS),
    batch_sizes: tuple[int, ...] | None = None,
    rows: list | None = None,
    batch_invariant: bool = False,
) -> list[dict]:
    """Every row of the grid, backend by backend, appended to `rows` (a report.CsvLog writes each out);
    with `batch_invariant` each backend in its batch-invariant form (EngineConfig.batch_invariant's)."""
    from tqdm.auto import tqdm

    sizes = tuple(batch_sizes or BATCH_SIZES["cuda" if device.type == "cuda" else "cpu"])
    if min(sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {', '.join(map(str, sizes))}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    grid = [(b, d, p, v) for b in backends for d in dtypes for p in phases for v in variants]
    rows = [] if rows is None else rows
    for b, d, p, v in tqdm(grid, desc="determinism", disable=None):
        rows.append(determinism_row(b, device, d, p, v, sizes, batch_invariant))
    return rows
