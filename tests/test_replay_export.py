"""`kernels --replay ... --export-flashinfer-bench DIR` (bench/replay_export.py): a recording's decode
steps become workloads of flashinfer-bench's paged GQA decode definition, whose reference computation
over the exported indices gives the attention the engine's metadata gives for that step."""

import json

import torch
from pagedbench.backends.registry import resolve
from safetensors.torch import load_file

from pagedbench.bench.replay import replay_metadata
from pagedbench.bench.replay_export import export_flashinfer_bench
from pagedbench.bench.step_record import read_recording
from tests.test_step_record import recorded_run

DEFINITION = "gqa_paged_decode_h8_kv4_d32_ps1"  # tiny-llama: 8 query heads, 4 KV heads, head dim 32
VAR_AXES = {"batch_size", "num_pages", "len_indptr", "num_kv_indices"}  # the definition's var axes


def definition_reference(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale):
    """flashinfer-bench's gqa_paged_decode reference at page size 1: each row over its listed slots."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    k, v = (c.flatten(0, 1).repeat_interleave(heads // kv_heads, dim=1) for c in (k_cache, v_cache))
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        scores = torch.einsum("hd,nhd->hn", q[b], k[slots]) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[slots])
    return out


def test_decode_steps_export_as_workloads_of_the_definition(tmp_path):
    _, path, _ = recorded_run("reference", tmp_path)
    header, steps = read_recording(path)
    export_flashinfer_bench(path, tmp_path / "fib")
    jsonl, count = export_flashinfer_bench(path, tmp_path / "fib")  # again: its lines replaced, not doubled
    assert jsonl == tmp_path / "fib" / "workloads" / "gqa_paged" / f"{DEFINITION}.jsonl"
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    decodes = [s for s in steps if max(s.query_lens) == 1]
    assert len(lines) == len(decodes) == count > 0 and len(decodes) < len(steps)  # prefill and mixed steps left out
    assert len({line["workload"]["uuid"] for line in lines}) == len(lines)
    impl = resolve("reference", "cpu", torch.float32, 32, 16, num_heads=8, num_kv_heads=4).cls(
        8, 4, 32, 32**-0.5, 16, torch.device("cpu"), torch.float32
    )
    k, v = (torch.randn(header["num_cache_blocks"], 16, 4, 32) for _ in "kv")
    for line, step in zip(lines, decodes):
        assert line["definition"] == DEFINITION and line["solution"] is None and line["evaluation"] is None
        axes, inputs = line["workload"]["axes"], line["workload"]["inputs"]
        assert set(axes) == VAR_AXES and set(inputs) == {
            "q",
            "k_cache",
            "v_cache",
            "kv_indptr",
            "kv_indices",
            "sm_scale",
        }
        blob = load_file(tmp_path / "fib" / inputs["kv_indices"]["path"])
        indptr, indices = blob["kv_indptr"], blob["kv_indices"]
        assert indptr.dtype == indices.dtype == torch.int32
        assert axes["len_indptr"] == axes["batch_size"] + 1 == len(indptr)  # the definition's constraints
        assert axes["num_kv_indices"] == indptr[-1].item() == len(indices)
        assert axes["num_pages"] == header["num_cache_blocks"] * 16 and int(indices.max()) < axes["num_pages"]
        q = torch.randn(axes["batch_size"], 8, 32)
        exported = definition_reference(q, k.view(-1, 1, 4, 32), v.view(-1, 1, 4, 32), indptr, indices, 32**-0.5)
        engine = impl.forward(q, k, v, impl.plan(replay_metadata(header, step, torch.device("cpu"))))
        torch.testing.assert_close(exported, engine)
