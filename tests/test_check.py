"""`pagedbench check`: the quick matrix through the command's own code path (every backend against
the dense oracle, two layouts), proof that it fails faulty backends with the case named, and the
oracle itself against plain causal SDPA."""

import dataclasses

import pandas as pd
import pytest
import torch
from pagedbench.backends import registry
from pagedbench.backends.reference import ReferenceBackend

from pagedbench.bench import check
from pagedbench.bench.capabilities import CASCADE_FEATURE, YES, capability_row, variant_columns
from pagedbench.bench.problems import attend_dense, place, random_problem
from pagedbench.entrypoints.cli.main import main
from tests.helpers import DEVICES

DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16, torch.float16, torch.float32]}


def on_device(case, device):
    """The case as this test runs it: on a CPU, latent attention at 96 dims (64 of values) instead of
    DeepSeek's 576 (512): the same kernel paths (absorbed latent, values a prefix of the key dims,
    sparse picks) at a sixth of the work; the long sequence at 512 tokens instead of 2,048 (still 32
    pages, four windows of 128). `pagedbench check` and a GPU run keep the real shapes."""
    if device != "cpu":
        return case
    if case.batch == "one long sequence":
        ((context, queries),) = case.seqs
        case = dataclasses.replace(case, seqs=[(512 - queries, queries)])
    if case.variant.value_dim is None:
        return case
    return dataclasses.replace(case, head_dim=96, variant=dataclasses.replace(case.variant, value_dim=64))


# The heaviest quick cases on a CPU (latent attention, gpt-oss's 64 heads, one long sequence) run in the
# full tier, and in fp32 only there: the dtype's handling is the kernels' shared path, which every
# other case runs in both dtypes (a GPU run, and `pagedbench check`, keep every dtype). The fast
# tier keeps every other case; tests/test_mla.py runs the latent kernels on small shapes.
HEAVY_ON_CPU = ("MLA", "GQA-8 64/8", "one long sequence")


def heavy(case, device) -> bool:
    return device == "cpu" and any(word in case.name for word in HEAVY_ON_CPU)


QUICK = [
    (on_device(case, device), device)
    for device in DEVICES
    for case in check.build_cases(DTYPES[device], full=False)
    if not (heavy(case, device) and case.dtype != torch.float32)
]


def quick_param(case, device):
    marks = [pytest.mark.slow] if heavy(case, device) else []
    return pytest.param(case, device, id=f"{case.name}-{device}", marks=marks)


@pytest.mark.parametrize("case,device", [quick_param(c, d) for c, d in QUICK])
def test_quick_matrix(case, device):
    rows = check.run_case(case, registry.list_backends(), torch.device(device))
    failures = [f"{r['backend']}: {r['reason']}" for r in rows if r["status"] == "fail"]
    assert not failures, f"{case.name}: " + "; ".join(failures)
    ran = {r["backend"] for r in rows if r["status"] == "pass"}
    assert {"reference", "sdpa", "flex"} <= ran  # these run everywhere; a skip would hide them
    for r in rows:
        if r["status"] == "skipped":
            assert r["reason"], r
    # `pagedbench backends` promises exactly what check runs: the case's cells are all ✓ iff it ran
    # (its variant's columns, and "shared pages": ✓ where the base settings run at all).
    # (A latent case's base head_dim, 576, is the latent column's own shape, probed with its values.)
    columns = ["shared pages"] * (case.variant.value_dim is None) + variant_columns(case.variant)
    columns += [CASCADE_FEATURE] * case.cascade
    for r in rows:
        cells = capability_row(r["backend"], torch.device(device), case.dtype, case.head_dim, case.block_size)
        assert (r["status"] != "skipped") == all(cells[c] == YES for c in columns), (r["backend"], cells)


def test_oracle_is_plain_causal_attention():
    """The oracle on one prefill equals PyTorch's causal SDPA on the same logical tensors."""
    problem = random_problem([(0, 37)], 4, 2, 32, seed=3)
    k = problem.k[0].repeat_interleave(2, dim=1).transpose(0, 1)
    v = problem.v[0].repeat_interleave(2, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(problem.q.transpose(0, 1), k, v, is_causal=True)
    torch.testing.assert_close(
        attend_dense(problem, 32**-0.5, torch.float64).float(), dense.transpose(0, 1), atol=1e-5, rtol=1e-5
    )


def test_layouts_share_pages_and_never_use_block_zero():
    case = next(c for c in check.build_cases([torch.float32], full=False) if c.batch == "shared prefix")
    problem = random_problem(case.seqs, 8, 2, 16, shared=case.shared)
    batch = place(problem, 16, layout_seed=1)
    table, seq_lens = batch.metadata.block_table.tolist(), batch.metadata.seq_lens_cpu
    pages = [row[: -(-n // 16)] for row, n in zip(table, seq_lens)]
    assert 0 not in {p for row in pages for p in row}
    assert pages[1][:3] == pages[0][:3] and pages[2][:2] == pages[0][:2]  # shared prefixes
    assert pages[3] == pages[0]  # a fork: every page, the partial last one too
    assert len(set(pages[1][3:]) | set(pages[0])) == len(pages[1][3:]) + len(pages[0])  # the rest are its own
    other = place(problem, 16, layout_seed=2).metadata.block_table.tolist()
    assert other != table


class IgnoresPartialLastPage(ReferenceBackend):
    """Reads only whole pages: the tokens on a sequence's partial last page are invisible."""

    name = "faulty-partial-page"

    def plan(self, meta):
        return [
            dataclasses.replace(s, kv_slots=s.kv_slots[: max(len(s.kv_slots) // meta.block_size * meta.block_size, 1)])
            for s in super().plan(meta)
        ]


class ReadsNeighboursPage(ReferenceBackend):
    """Takes sequence i's last page from sequence i+1's table."""

    name = "faulty-neighbour"

    def plan(self, meta):
        table = meta.block_table.clone()
        for i in range(meta.num_seqs - 1):
            last = -(-meta.seq_lens_cpu[i] // meta.block_size) - 1
            table[i, last] = meta.block_table[i + 1, 0]
        return super().plan(dataclasses.replace(meta, block_table=table))


class DependsOnPlacement(ReferenceBackend):
    """Orders each sequence's keys by physical slot instead of logical position (right only when
    a sequence's pages happen to ascend), so its causal mask depends on where pages sit."""

    name = "faulty-placement"

    def plan(self, meta):
        return [dataclasses.replace(s, kv_slots=s.kv_slots.sort().values) for s in super().plan(meta)]


@pytest.mark.parametrize(
    "faulty,batch",
    [(IgnoresPartialLastPage, "decode"), (ReadsNeighboursPage, "mixed"), (DependsOnPlacement, "chunked prefill")],
)
def test_check_fails_faulty_backends_naming_the_case(monkeypatch, tmp_path, capsys, faulty, batch):
    monkeypatch.setitem(registry._loaded, faulty.name, faulty)
    every_case = check.build_cases
    monkeypatch.setattr(
        check, "build_cases", lambda dtypes, full: [c for c in every_case(dtypes, full) if c.batch == batch][:1]
    )
    code = main(
        [
            "check",
            "--backends",
            f"reference,{faulty.name}",
            "--device",
            "cpu",
            "--dtypes",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and "check failed: 1 case(s)" in err
    rows = pd.read_csv(tmp_path / "check.csv")
    bad = rows[rows["backend"] == faulty.name].iloc[0]
    assert bad["status"] == "fail" and bad["case"].startswith(batch) and bad["case"] in out
    assert "> tolerance" in bad["reason"] or "with the page layout" in bad["reason"]
    assert (rows[rows["backend"] == "reference"]["status"] == "pass").all()


def test_check_command_passes_and_writes_reports(monkeypatch, tmp_path, capsys):
    every_case = check.build_cases
    monkeypatch.setattr(
        check,
        "build_cases",
        lambda dtypes, full: [c for c in every_case(dtypes, full) if c.batch in ("mixed", "shared prefix")][:2],
    )
    # (the backends' kernels are tested above, case by case; the command's path needs only two and a skip)
    assert main(["check", "--device", "cpu", "--backends", "reference,sdpa,flash-attn", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "check.csv")
    assert set(rows["status"]) <= {"pass", "skipped"}
    assert (rows[rows["backend"] == "flash-attn"]["status"] == "skipped").all()
    assert rows[rows["status"] == "pass"]["max_abs_error"].le(rows[rows["status"] == "pass"]["tolerance"]).all()
    assert "Skipped (never counted as passed)" in out and "flash-attn" in out
    assert "Correctness check" in (tmp_path / "check.md").read_text()


@pytest.mark.slow
def test_engine_check_teacher_forces_the_model_through_each_backend(monkeypatch):
    """Whole-model logits, prompts in two chunks then forced decode steps, against reference's in the
    same dtype: sdpa and flex pass in fp32 and bf16; a backend reading a neighbour's page fails."""
    monkeypatch.setitem(registry._loaded, ReadsNeighboursPage.name, ReadsNeighboursPage)
    rows = check.engine_check(
        ["reference", "sdpa", "flex", ReadsNeighboursPage.name],
        torch.device("cpu"),
        [torch.float32, torch.bfloat16],
        num_seqs=3,
        prompt_len=30,
        steps=8,
    )
    verdict = {(r["backend"], r["dtype"]): r for r in rows}
    for backend in ("sdpa", "flex"):
        for dtype in ("float32", "bfloat16"):
            row = verdict[backend, dtype]
            assert row["status"] == "pass" and row["top1_agreement"] == 1.0, row
    assert verdict["sdpa", "float32"]["max_abs_error"] < 1e-4
    bad = verdict[ReadsNeighboursPage.name, "float32"]
    assert bad["status"] == "fail" and "logits differ" in bad["reason"]


def test_helpers_start_only_where_they_pay(monkeypatch):
    """One helper per spare free core (capped) on a CPU for a grid of configurations with flex or triton;
    none on CUDA, for fast backends only, for a handful of cases, or for a backend registered at
    run time (a fresh process could not load it)."""
    from pagedbench.bench import check_parallel

    groups, cpu = check_parallel.groups_of(check.build_cases([torch.float32], full=False)), torch.device("cpu")
    monkeypatch.setattr(check_parallel, "default_threads", lambda: (2, "2 usable cores, 0 busy at start"))
    assert check_parallel.helper_count(groups, ["reference", "flex"], cpu) == 1
    assert check_parallel.helper_count(groups, ["triton"], cpu) == 1
    assert check_parallel.helper_count(groups, ["reference", "sdpa"], cpu) == 0
    assert check_parallel.helper_count(groups, ["flex"], torch.device("cuda")) == 0
    assert check_parallel.helper_count(groups[:3], ["flex"], cpu) == 0
    monkeypatch.setitem(registry._loaded, ReadsNeighboursPage.name, ReadsNeighboursPage)
    assert check_parallel.helper_count(groups, ["flex", ReadsNeighboursPage.name], cpu) == 0
    monkeypatch.setattr(check_parallel, "default_threads", lambda: (64, "64 usable cores, 0 busy at start"))
    assert check_parallel.helper_count(groups, ["flex"], cpu) == check_parallel.MAX_HELPERS
    monkeypatch.setattr(check_parallel, "default_threads", lambda: (1, "2 usable cores, 1 busy at start"))
    assert check_parallel.helper_count(groups, ["flex"], cpu) == 0  # no helper on a busy core


def test_check_and_helpers_claim_every_configuration_once(tmp_path):
    """The check claims from the front until it meets a helper's claim; two helpers walk from the
    back, each passing over what the other took: every configuration is claimed exactly once."""
    from pagedbench.bench.check_parallel import Sharing, compile_group, groups_of

    cases = check.build_cases([torch.float32], full=False)
    groups = groups_of(cases)
    assert [c for g in groups for c in g] == cases
    assert all(len({compile_group(c) for c in g}) == 1 for g in groups)
    assert all(compile_group(a[-1]) != compile_group(b[0]) for a, b in zip(groups, groups[1:]))
    caps = next(g for g in groups if g[0].variant.softcap)  # caps 50 and 30: one graph, one configuration
    assert {c.variant.softcap for c in caps} == {50.0, 30.0}
    check_side, helpers = Sharing(groups, tmp_path), [Sharing(groups, tmp_path) for _ in range(2)]
    mine, owners = check_side.mine(), {}
    backwards = [reversed(range(len(groups))) for _ in helpers]
    for step in range(3 * len(groups)):  # interleaved: check, helper 0, helper 1, ...
        if step % 3 == 0:
            index = next(mine, None)
            if index is not None:
                owners.setdefault(index, []).append("check")
        else:
            h = step % 3 - 1
            for index in backwards[h]:  # a helper passes over taken ones to its next claim
                if helpers[h].claim(index):
                    owners.setdefault(index, []).append(f"helper {h}")
                    break
    assert sorted(owners) == list(range(len(groups))) and all(len(o) == 1 for o in owners.values())
    first = check_side.first_theirs
    assert all(owners[i] == ["check"] for i in range(first)) and 0 < first < len(groups)
    assert all(owners[i] != ["check"] for i in range(first, len(groups)))
    assert {o[0] for i, o in owners.items() if i >= first} == {"helper 0", "helper 1"}
    assert Sharing(groups).claim(0) and list(Sharing(groups).mine()) == list(range(len(groups)))  # no helpers


def _share(groups, monkeypatch):
    """Run `groups` through check_parallel with one helper and tests.helpers.rows_with_pid, the check
    waiting until the helper has claimed a configuration: (rows by group, log of the check)."""
    import time

    from pagedbench.bench import check_parallel
    from tests.helpers import rows_with_pid

    monkeypatch.setattr(check_parallel, "default_threads", lambda: (2, "2 usable cores, 0 busy at start"))
    cpu, by_group = torch.device("cpu"), {}
    with check_parallel.sharing_groups(groups, ["triton"], cpu, rows_with_pid) as sharing:
        deadline = time.monotonic() + 120
        while not sharing.claimed(len(groups) - 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        for index in sharing.mine():
            by_group[index] = [row for case in groups[index] for row in rows_with_pid(case, ["triton"], cpu)]
        by_group.update(sharing.collect())
    return by_group


@pytest.mark.slow
def test_helpers_run_configurations_from_the_far_end(monkeypatch, caplog):
    import os

    from pagedbench.bench.check_parallel import groups_of

    groups = groups_of(check.build_cases([torch.float32], full=False))
    with caplog.at_level("INFO", logger="pagedbench"):
        by_group = _share(groups, monkeypatch)
    assert sorted(by_group) == list(range(len(groups)))
    assert [[row["case"] for row in by_group[i]] for i in range(len(groups))] == [[c.name for c in g] for g in groups]
    pids = [{row["pid"] for row in by_group[i]} for i in range(len(groups))]
    helper = [i for i, p in enumerate(pids) if p != {os.getpid()}]
    assert helper and helper == list(range(helper[0], len(groups)))  # the far end, contiguous
    assert "1 helper process(es)" in caplog.text and "a helper died" not in caplog.text


@pytest.mark.slow
def test_a_configuration_whose_helper_died_runs_in_the_check(monkeypatch, caplog):
    import dataclasses
    import os

    from pagedbench.bench.check_parallel import groups_of

    groups = groups_of(check.build_cases([torch.float32], full=False))
    groups[-1] = [dataclasses.replace(groups[-1][0], batch="dies")]  # the helper's first claim
    with caplog.at_level("INFO", logger="pagedbench"):
        by_group = _share(groups, monkeypatch)
    assert sorted(by_group) == list(range(len(groups)))
    assert {row["pid"] for rows in by_group.values() for row in rows} == {os.getpid()}
    assert "a helper died; the check runs configuration" in caplog.text


@pytest.mark.slow
def test_check_with_a_helper_gives_the_serial_rows_in_grid_order(monkeypatch, caplog):
    """Through run_check on real backends: rows equal to a serial run's, in grid order."""
    from pagedbench.bench import check_parallel

    every_case = check.build_cases
    # (the small GQA-4 configurations only: five of them, enough for a helper; the sharing is what is tested)
    few = lambda dtypes, full: [  # noqa: E731
        c for c in every_case(dtypes, full) if c.batch in ("mixed", "length one") and "GQA-4 d64" in c.name
    ]
    monkeypatch.setattr(check, "build_cases", few)
    monkeypatch.setattr(check_parallel, "default_threads", lambda: (2, "2 usable cores, 0 busy at start"))
    backends, cpu = ["reference", "sdpa", "triton"], torch.device("cpu")
    assert len(check_parallel.groups_of(few([torch.float32], False))) >= check_parallel.MIN_GROUPS
    with caplog.at_level("INFO", logger="pagedbench"):
        parallel = check.run_check(backends, cpu, [torch.float32])
    assert "1 helper process(es)" in caplog.text and "a helper died" not in caplog.text
    monkeypatch.setattr(check_parallel, "helper_count", lambda *args: 0)
    serial = check.run_check(backends, cpu, [torch.float32])
    keys = ["case", "backend", "status", "max_abs_error", "placement_diff"]
    assert [{k: r.get(k) for k in keys} for r in parallel] == [{k: r.get(k) for k in keys} for r in serial]
