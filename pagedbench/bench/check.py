"""`pagedbench check`: every available backend against a dense oracle on a grid of paged-attention
problems (attention_batch builds them; the oracle never reads the paged cache).

Per case and backend: the max and mean absolute error against the oracle (fp64 on CPU, fp32 on
GPU), the same problem on a second random layout (placement invariance), and pass/fail against
the dtype's tolerance: TOLERANCE_FACTOR x the error of the naive computation in that dtype (every
operation in it, softmax included) plus a small floor, as peers' kernel tests derive it.
"""

import zlib
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from pagedbench.backends.base import PLAIN, AttentionVariant, one_line
from pagedbench.backends.cascade import with_cascade
from pagedbench.backends.registry import resolve
from pagedbench.bench.problems import attend_dense, error_columns, place, random_problem
from pagedbench.device.dtypes import dtype_name

TOLERANCE_FACTOR = 4.0
TOLERANCE_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
HEADS = {
    "MHA": (4, 4),
    "GQA-4": (8, 2),
    "GQA-3": (6, 2),
    "MQA": (4, 1),
    "MLA-16": (16, 1),
    "MLA-128": (128, 1),
    "GQA-8 64/8": (64, 8),  # gpt-oss's
}
# gpt-oss's attention: 64 query / 8 KV heads of 64, a sink per head, and on every other layer a
# 128-token window (the mixed batch's contexts reach past it, the decode batch's long ones too).
GPT_OSS = {"heads": "GQA-8 64/8", "head_dim": 64, "variant": AttentionVariant(sliding_window=128, sinks=True)}
SINKS_ONLY = AttentionVariant(sinks=True)  # gpt-oss's full-attention layers
# Latent attention as DeepSeek-V3 decodes it, absorbed: H query heads of 512 + 64 meet one latent
# "KV head" whose first 512 dims are the values, in pages of 64 (FlashMLA's); 128 heads is V3's
# decode, 16 a TP-8 rank's.
LATENT = AttentionVariant(value_dim=512)
LATENT_CONFIGS = (
    {"heads": "MLA-16", "head_dim": 576, "block_size": 64, "variant": LATENT},
    {"heads": "MLA-128", "head_dim": 576, "block_size": 64, "variant": LATENT},
)
# DeepSeek-V3.2's sparse attention over that latent cache: each query reads 64 of its past tokens
# (V3.2 reads 2,048 of contexts to 128k; here contexts reach 320), picked at random over its pages.
SPARSE = {"heads": "MLA-16", "head_dim": 576, "block_size": 64, "variant": AttentionVariant(value_dim=512, topk=64)}


@dataclass(slots=True)
class CheckCase:
    batch: str  # what the batch exercises
    seqs: list[tuple[int, int]]  # (context_len, query_len) per sequence
    heads: str = "GQA-4"
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)
    variant: AttentionVariant = PLAIN
    cascade: bool = False  # cascade attention: every sequence with full pages in a group (backends/cascade.py)

    @property
    def name(self) -> str:
        variant = "" if self.variant == PLAIN else f" [{self.variant}]"
        return f"{self.batch} {self.heads} d{self.head_dim} page{self.block_size} {dtype_name(self.dtype)}{variant}"

    def sinks(self, num_heads: int) -> torch.Tensor | None:
        """The case's sink logits [H] (fp32, spread around the scores' range), or None."""
        if not self.variant.sinks:
            return None
        return torch.randn(num_heads, generator=torch.Generator().manual_seed(self.seed)) * 2

    @property
    def seed(self) -> int:  # stable across processes (never Python's hash())
        return zlib.crc32(self.batch.encode())


def _batches(block_size: int, long_context: int) -> dict[str, tuple[list[tuple[int, int]], dict]]:
    """Batch shapes, by name: (seqs, shared). Lengths sit on, one below and one above page boundaries."""
    p = block_size
    return {
        "decode": ([(p - 1, 1), (p, 1), (2 * p - 2, 1), (37, 1), (5 * p, 1)], {}),
        "prefill": ([(0, p), (0, p + 1), (0, 3 * p - 1), (0, 45)], {}),
        "mixed": ([(p - 2, 1), (3 * p, 1), (0, 2 * p + 1), (p + 3, 7), (2 * p - 1, p + 2)], {}),
        "chunked prefill": ([(3 * p + 5, 2 * p), (p, p - 1), (4 * p, 3)], {}),
        # Speculative decoding's verify step: a few query tokens after a long context, no one-token decodes.
        "multi-token decode": ([(5 * p + 3, 4), (p - 1, 2), (7 * p, 5), (2 * p, 3)], {}),
        "one long sequence": ([(long_context - 33, 33)], {}),
        "many short": ([(i % 7, 1 + i % 3) for i in range(48)], {}),
        "length one": ([(0, 1), (0, 1), (1, 1), (0, 1)], {}),
        "page boundaries": ([(p - 1, 1), (p - 1, 2), (p, 1), (0, p), (0, p - 1), (p, p), (2 * p - 1, 1)], {}),
        "shared prefix": (
            [(3 * p + 2, 1), (3 * p + 9, 1), (2 * p, p + 4), (3 * p + 2, 1)],
            {1: (0, 3 * p), 2: (0, 2 * p), 3: (0, 3 * p + 3)},
        ),  # 3 is a fork of 0
    }


def _cascade_batches(block_size: int) -> dict[str, tuple[list[tuple[int, int]], dict]]:
    """Cascade's batches: groups of 1 to 64 decode-type sequences over prefixes of 0, 1 and many pages,
    ragged suffixes (every sequence with a full page joins a group, alone if it shares none)."""
    p = block_size
    sizes = (1, 2, 3, 8)  # groups of these sizes, over prefixes of 1, 5, 2 and 9 pages
    seqs, shared, first = [], {}, 0
    for size, pages in zip(sizes, (1, 5, 2, 9)):
        for i in range(size):
            seqs.append((pages * p + (7 * i) % (2 * p) + 1, 1))
            if i:
                shared[first + i] = (first, pages * p)
        first += size
    seqs.append((p - 3, 1))  # no full page: a prefix of 0, flat
    return {
        "cascade decode groups 1-8": (seqs, shared),
        "cascade decode 64 x 8 pages": (
            [(8 * p + 1 + (5 * i) % 70, 1) for i in range(64)],
            {b: (0, 8 * p) for b in range(1, 64)},
        ),  # fmt: skip
        "cascade one page": ([(p + i % 11, 1) for i in range(16)], {b: (0, p) for b in range(1, 16)}),
        "cascade multi-token decode": (
            [(5 * p + 3, 4), (5 * p + 9, 2), (5 * p, 5), (6 * p + 1, 3), (0, 21)],
            {1: (0, 5 * p), 2: (0, 5 * p), 3: (0, 5 * p)},
        ),  # the prefill row runs flat
    }


# Where backends differ: a window shorter than most contexts (Mistral/Gemma's, scaled down), Gemma 2's
# soft-cap values, gpt-oss's sinks, and all three at once.
VARIANTS = {
    "window": AttentionVariant(sliding_window=37),
    "soft-cap 50": AttentionVariant(softcap=50.0),
    "soft-cap 30": AttentionVariant(softcap=30.0),
    "sinks": AttentionVariant(sinks=True),
    "window + soft-cap + sinks": AttentionVariant(sliding_window=20, softcap=30.0, sinks=True),
}


# --quick's configurations beside the default (GQA-4, head_dim 64, page 16): each other head
# layout, head_dim and page size, and the two large sizes together, in three configurations
# rather than five one-at-a-time (each configuration costs a compiled flex graph per call kind).
QUICK_CONFIGS = (
    {"heads": "MHA", "head_dim": 128},
    {"heads": "GQA-3", "block_size": 128},
    {"heads": "MQA", "head_dim": 128, "block_size": 128},
)


def build_cases(dtypes: list[torch.dtype], full: bool) -> list[CheckCase]:
    """--quick: every batch shape on one configuration, then QUICK_CONFIGS on the mixed and
    shared-prefix batches, latent attention (16 heads: decode, mixed, shared prefix; 128: decode), its
    top-64 sparse form (16 heads: decode, prefill, mixed),
    gpt-oss's layers (64/8 heads of 64, sinks, with and without its 128-token window: decode, mixed,
    one long sequence), then each variant on the mixed batch (and the window on the chunked-prefill and shared-prefix
    ones), then cascade's (_cascade_cases). --full: the whole cross product, then every variant, latent
    configuration and gpt-oss's windowed layer on every batch, then cascade's."""
    cases = []
    for dtype in dtypes:
        if full:
            for block_size in (16, 32, 64, 128, 256):
                for heads in HEADS:
                    for head_dim in (64, 128, 256):
                        for batch, (seqs, shared) in _batches(block_size, 16384).items():
                            cases.append(CheckCase(batch, seqs, heads, head_dim, block_size, dtype, shared))
            for variant in VARIANTS.values():
                for batch, (seqs, shared) in _batches(16, 2048).items():
                    cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, variant=variant))
            for latent in LATENT_CONFIGS:
                for batch, (seqs, shared) in _batches(latent["block_size"], 4096).items():
                    cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **latent))
            for batch, (seqs, shared) in _batches(16, 4096).items():
                cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **GPT_OSS))
            for batch, (seqs, shared) in _batches(SPARSE["block_size"], 4096).items():
                cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **SPARSE))
            cases += _cascade_cases(dtype)
            continue
        for batch, (seqs, shared) in _batches(16, 2048).items():
            cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared))
        for change in QUICK_CONFIGS:
            for batch in ("mixed", "shared prefix"):
                seqs, shared = _batches(change.get("block_size", 16), 2048)[batch]
                cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **change))
        for latent, batch_names in zip(LATENT_CONFIGS, (("decode", "mixed", "shared prefix"), ("decode",))):
            for batch in batch_names:
                seqs, shared = _batches(latent["block_size"], 2048)[batch]
                cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **latent))
        for batch in ("decode", "prefill", "mixed"):
            seqs, shared = _batches(SPARSE["block_size"], 2048)[batch]
            cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **SPARSE))
        for batch in ("decode", "mixed", "one long sequence"):
            seqs, shared = _batches(16, 2048)[batch]
            cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **GPT_OSS))
            cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, **(GPT_OSS | {"variant": SINKS_ONLY})))
        batches = _batches(16, 2048)
        for name, variant in VARIANTS.items():
            for batch in ("mixed", "chunked prefill", "shared prefix") if name == "window" else ("mixed",):
                seqs, shared = batches[batch]
                cases.append(CheckCase(batch, seqs, dtype=dtype, shared=shared, variant=variant))
        cases += _cascade_cases(dtype)
    return cases


def _cascade_cases(dtype: torch.dtype) -> list[CheckCase]:
    """Every cascade batch, then the groups of 1-8 under every variant kind at once and two other head layouts,
    and a window reaching into a one-page prefix."""
    batches = _cascade_batches(16)
    cases = [
        CheckCase(batch, seqs, dtype=dtype, shared=shared, cascade=True) for batch, (seqs, shared) in batches.items()
    ]
    seqs, shared = batches["cascade decode groups 1-8"]
    for change in (
        {"variant": VARIANTS["window + soft-cap + sinks"]},
        {"heads": "MHA", "head_dim": 128},
        {"heads": "MQA"},
    ):
        cases.append(CheckCase("cascade decode groups 1-8", seqs, dtype=dtype, shared=shared, cascade=True, **change))
    seqs, shared = batches["cascade one page"]  # a window that reaches into the one-page prefix
    cases.append(
        CheckCase("cascade one page", seqs, dtype=dtype, shared=shared, cascade=True, variant=VARIANTS["window"])
    )
    return cases


def tolerance(problem, scale: float, case: CheckCase, device: torch.device, expected: torch.Tensor, sinks) -> float:
    dtype = case.dtype
    naive = attend_dense(problem, scale, dtype, device, case.variant, sinks)
    return TOLERANCE_FACTOR * float((naive.to(expected.dtype) - expected).abs().max()) + TOLERANCE_FLOOR[dtype]


def run_case(case: CheckCase, backends: list[str], device: torch.device) -> list[dict]:
    """One row per backend: errors against the oracle and between two layouts, and the verdict."""
    num_heads, num_kv_heads = HEADS[case.heads]
    scale = case.head_dim**-0.5
    oracle_dtype = torch.float64 if device.type == "cpu" else torch.float32
    problem = random_problem(
        case.seqs, num_heads, num_kv_heads, case.head_dim, case.dtype, case.seed, case.shared,
        case.variant.value_dim, case.variant.topk,
    )  # fmt: skip
    sinks = case.sinks(num_heads)
    expected = attend_dense(problem, scale, oracle_dtype, device, case.variant, sinks)
    tol = tolerance(problem, scale, case, device, expected, sinks)
    layouts = None
    head = {
        "case": case.name,
        "batch": case.batch,
        "heads": case.heads,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": case.head_dim,
        "block_size": case.block_size,
        "dtype": dtype_name(case.dtype),
        "variant": str(case.variant),
        "num_seqs": len(case.seqs),
        "num_query_tokens": problem.q.shape[0],
        "tolerance": tol,
    }
    rows = []
    for name in backends:
        cls, provider, reason = resolve(
            name,
            device,
            case.dtype,
            case.head_dim,
            case.block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            **case.variant.settings(),
            **({"cascade_attention": True} if case.cascade else {}),
        )[1:]
        row = {**head, "backend": name, "provider": provider}
        if reason:
            rows.append({**row, "status": "skipped", "reason": reason})
            continue
        layouts = layouts or [
            _cascaded(place(problem, case.block_size, device, layout_seed=seed, spare_blocks=5), case)
            for seed in (1, 2)
        ]
        try:
            outs = [_attend(cls, batch, num_heads, num_kv_heads, case, scale, sinks) for batch in layouts]
        except Exception as e:  # a backend that raises fails this case; the others go on
            rows.append({**row, "status": "fail", "reason": f"raised {one_line(e)}"})
            continue
        error = (outs[0].to(expected.dtype) - expected).abs()
        moved = float((outs[1].to(expected.dtype) - outs[0].to(expected.dtype)).abs().max())
        row.update(error_columns(outs[0], expected), mean_abs_error=float(error.mean()), placement_diff=moved)
        why = []
        if not bool(torch.isfinite(outs[0]).all()):
            why.append("non-finite output")
        if row["max_abs_error"] > tol:
            worst = int(error.amax(dim=(1, 2)).argmax())
            why.append(f"error {row['max_abs_error']:.3g} > tolerance {tol:.3g} (worst at query token {worst})")
        if moved > tol:
            why.append(f"output changes by {moved:.3g} with the page layout (tolerance {tol:.3g})")
        rows.append({**row, "status": "fail" if why else "pass", "reason": "; ".join(why)})
    return rows


def _cascaded(batch, case: CheckCase):
    """The placed batch with its cascade plan (groups of one included) when the case asks for cascade."""
    if case.cascade:
        batch.metadata = with_cascade(batch.metadata, True, min_members=1)
        assert batch.metadata.cascade is not None, f"{case.name}: no cascade group"
    return batch


def _attend(cls, batch, num_heads: int, num_kv_heads: int, case: CheckCase, scale: float, sinks) -> torch.Tensor:
    device = batch.q.device
    variant = {} if case.variant == PLAIN else {"variant": case.variant}  # third-party backends may predate it
    backend = cls(num_heads, num_kv_heads, case.head_dim, scale, case.block_size, device, case.dtype, **variant)
    return attend(backend, batch, sinks)


def attend(backend, batch, sinks: torch.Tensor | None) -> torch.Tensor:
    """One plan() + forward() of `backend` on a placed batch (sinks and sparse selections passed when there)."""
    device = batch.q.device
    state = backend.plan(batch.metadata)
    extra = {} if sinks is None else {"sinks": sinks.to(device)}  # a backend with no variant need not know them
    if batch.selected is not None:
        extra["selected"] = batch.selected
    return backend.forward(batch.q, batch.k_cache, batch.v_cache, state, **extra)


def run_check(
    backends: list[str], device: torch.device, dtypes: list[torch.dtype], full: bool = False, rows: list | None = None
) -> list[dict]:
    """Every case of the grid; rows are appended to `rows` (a report.CsvLog writes each out) in grid
    order. On a multi-core CPU, helper processes run configurations from the far end (`check_parallel`);
    under torchrun, each rank runs every world-th configuration and rank 0 gets every row (`ranks`)."""
    from pagedbench.bench.check_parallel import groups_of, sharing_groups
    from pagedbench.bench.ranks import gather_rows, grid_world

    rows = [] if rows is None else rows
    groups = groups_of(build_cases(dtypes, full))
    rank, world = grid_world()
    if world > 1:  # under torchrun: every world-th configuration here, rank 0 gathers them all
        mine = {
            i: [row for case in groups[i] for row in run_case(case, backends, device)]
            for i in range(rank, len(groups), world)
        }
        rows += gather_rows(mine) or []
        return rows
    with (
        tqdm(total=sum(map(len, groups)), desc="check", disable=None) as bar,
        sharing_groups(groups, backends, device, run_case) as sharing,
    ):
        try:
            for index in sharing.mine():
                for case in groups[index]:
                    rows += run_case(case, backends, device)
                    bar.update()
        except KeyboardInterrupt:  # keep what the helpers finished too
            rows += [row for _, group_rows in sorted(sharing.collect(wait=False).items()) for row in group_rows]
            raise
        for index, group_rows in sorted(sharing.collect().items()):
            rows += group_rows
            bar.update(len(groups[index]))
    return rows


def summary(rows: list[dict]) -> str:
    """Counts per backend, then every failure with its case."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    keys = ["backend", "dtype"]
    counts = frame.groupby(keys + ["status"]).size().unstack(fill_value=0)
    for status in ("pass", "fail", "skipped"):
        if status not in counts:
            counts[status] = 0
    ran = frame[frame["status"] != "skipped"]
    if "max_abs_error" in ran:
        counts["worst error"] = ran.groupby(keys)["max_abs_error"].max()
        counts["worst error / tolerance"] = (
            (ran["max_abs_error"] / ran["tolerance"]).groupby([ran[k] for k in keys]).max()
        )
        if "placement_diff" in ran:  # (the gated DeltaNet cases have no pages)
            counts["worst placement diff"] = ran.groupby(keys)["placement_diff"].max()
    lines = [counts.reset_index().to_markdown(index=False)]
    failed = frame[frame["status"] == "fail"]
    if len(failed):
        lines.append("\nFailures:\n\n" + failed[["backend", "case", "reason"]].to_markdown(index=False))
    skipped = frame[frame["status"] == "skipped"][["backend", "reason"]].drop_duplicates()
    if len(skipped):
        lines.append("\nSkipped (never counted as passed):\n\n" + skipped.to_markdown(index=False))
    return "\n".join(lines)


# --- engine level: the whole model, teacher-forced ----------------------------------------------

ENGINE_NOISE_FLOOR = 1e-4  # logits: below this, differences are rounding in any dtype
ENGINE_FACTOR = 8.0  # a backend's logits may differ from reference's by this x the dtype's own noise


def teacher_forced_logits(
    model: str,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    tokens: list[list[int]],
    prompt_lens: list[int],
    block_size: int = 16,
    layout_seed: int = 0,
    resolved=None,
    compile: bool | None = None,
) -> torch.Tensor:
    """fp32 logits [steps, B, vocab] of every sequence at the end of its prompt and after each
    forced continuation token: the prompt in two chunks (a chunked prefill), then one decode step
    per token, on pages scattered at random through the cache. `resolved`: `model` as the command
    resolved it (a ResolvedModel; else the engine resolves it)."""
    from pagedbench.config import EngineConfig
    from pagedbench.engine.llm_engine import LLMEngine
    from pagedbench.engine.sequence import Sequence
    from pagedbench.sample.sampling_params import SamplingParams
    from pagedbench.worker.step_batch import build_step_inputs

    pages = [-(-len(t) // block_size) for t in tokens]
    engine = LLMEngine(
        EngineConfig(
            model=model,
            backend=backend,
            device=str(device),
            dtype=dtype,
            block_size=block_size,
            num_blocks=sum(pages) + 8,
            seed=0,
            compile=compile,
            preset_init="plain",  # soft attention everywhere: the whole model's numerics are compared
        ),
        model=resolved,
    )
    runner = engine.runner
    free = (torch.randperm(engine.num_blocks - 1, generator=torch.Generator().manual_seed(layout_seed)) + 1).tolist()
    seqs, tables = [], []
    for i, (ids, n) in enumerate(zip(tokens, pages)):
        seqs.append(Sequence(str(i), None, list(ids), SamplingParams()))
        tables.append(free[:n])
        free = free[n:]
    first_chunk = [max(1, n // 2) for n in prompt_lens]
    schedule = [first_chunk, [n - c for n, c in zip(prompt_lens, first_chunk)]]
    schedule += [[1] * len(seqs)] * min(len(t) - n for t, n in zip(tokens, prompt_lens))
    logits = []
    for step, num_new in enumerate(schedule):
        for s, table, n in zip(seqs, tables, num_new):  # the pages a sequence holds so far
            s.block_table = table[: -(-(s.num_computed_tokens + n) // block_size)]
        inputs = build_step_inputs(seqs, num_new, block_size, runner.num_cache_blocks, device)
        ends = torch.tensor(inputs.metadata.query_start_loc_cpu[1:], device=device) - 1
        inputs.logits_indices = ends  # every sequence's last token, prompt finished or not
        out = runner.run(inputs, runner.backend.plan(inputs.metadata))
        if step:
            logits.append(out.float().cpu())
        for s, n in zip(seqs, num_new):
            s.num_computed_tokens += n
    return torch.stack(logits)


def engine_check(
    backends: list[str],
    device: torch.device,
    dtypes: list[torch.dtype],
    model: str = "tiny-llama",
    num_seqs: int = 4,
    prompt_len: int = 40,
    steps: int = 24,
    compile: bool | None = None,
) -> list[dict]:
    """Each backend's teacher-forced logits against `reference`'s in the same dtype: max abs
    difference, held to ENGINE_FACTOR x that dtype's own noise (reference in the dtype vs in fp32),
    and top-1 agreement where reference's top-2 gap exceeds the noise. `compile`: the backends'
    engines run the model compiled (or not; None: the device's default); the reference never is."""
    from pagedbench.config import EngineConfig
    from pagedbench.model.loader import resolve_model_config

    resolved = resolve_model_config(model)  # once for every backend and dtype
    vocab = resolved.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [prompt_len - 7 * i for i in range(num_seqs)]  # ragged, on and off page boundaries
    tokens = [torch.randint(3, vocab, (n + steps,), generator=gen).tolist() for n in prompt_lens]
    rows = []
    oracle = dict(resolved=resolved, compile=False)
    fp32 = teacher_forced_logits(model, "reference", device, torch.float32, tokens, prompt_lens, **oracle)
    for dtype in dtypes:
        expected = teacher_forced_logits(model, "reference", device, dtype, tokens, prompt_lens, **oracle)
        noise = max(float((expected - fp32).abs().max()), ENGINE_NOISE_FLOOR)
        top2 = expected.topk(2, dim=-1).values
        decisive = (top2[..., 0] - top2[..., 1]) > 2 * noise
        compiled = EngineConfig(model=model, compile=compile).compiles(device)
        case = f"engine {model} teacher-forced {dtype_name(dtype)}" + (" compiled" if compiled else "")
        head = {
            "case": case,
            "batch": "engine",
            "dtype": dtype_name(dtype),
            "num_seqs": num_seqs,
            "num_query_tokens": sum(prompt_lens) + steps * num_seqs,
            "tolerance": ENGINE_FACTOR * noise,
        }
        for name in backends:
            if name == "reference":
                continue
            row = {**head, "backend": name}
            try:
                got = teacher_forced_logits(
                    model, name, device, dtype, tokens, prompt_lens, layout_seed=1, resolved=resolved, compile=compile
                )
            except ValueError as e:  # unavailable here: the engine says why
                rows.append({**row, "status": "skipped", "reason": str(e)})
                continue
            rows.append(_compare_logits(row, got, expected, decisive))
    return rows


def _compare_logits(row: dict, got: torch.Tensor, expected: torch.Tensor, decisive: torch.Tensor) -> dict:
    """`row` with the max abs logit difference and the top-1 agreement where reference is
    decisive, and its verdict against row["tolerance"]."""
    diff = float((got - expected).abs().max())
    agree = (got.argmax(-1) == expected.argmax(-1))[decisive].float()
    top1 = float(agree.mean()) if agree.numel() else float("nan")
    why = []
    if diff > row["tolerance"]:
        why.append(f"logits differ by {diff:.3g} > {row['tolerance']:.3g}")
    if agree.numel() and top1 < 1.0:
        why.append(f"top-1 differs at {int((agree == 0).sum())} of {agree.numel()} decisive positions")
    return {
        **row,
        "max_abs_error": diff,
        "top1_agreement": top1,
        "status": "fail" if why else "pass",
        "reason": "; ".join(why) or f"{agree.numel()} decisive positions of {decisive.numel()}",
    }
