"""`kernels --replay <steps.jsonl> --export-flashinfer-bench DIR`: a recording's decode steps as
flashinfer-bench workloads of its paged GQA decode definition, so its harness runs the same steps.

flashinfer-bench's `gqa_paged_decode_h{H}_kv{KV}_d{D}_ps1` definitions take q [batch_size, H, D], the
cache [num_pages, 1, KV, D] twice, kv_indptr [batch_size + 1] and kv_indices [num_kv_indices] (int32,
the token slots each sequence reads) and sm_scale. A page of P tokens is written as its P one-token
slots (page p, offset o: slot p * P + o), so each sequence lists exactly the tokens it attends to and
the cache keeps the engine's size (num_pages = pages x P). A workload is a JSON line
{"definition", "workload": {"uuid", "axes", "inputs"}, "solution": null, "evaluation": null}: q and the
cache random, the indices from a safetensors blob, sm_scale the layer's scale, laid out as
flashinfer-trace's dataset is (workloads/gqa_paged/<definition>.jsonl, blob/workloads/gqa_paged/...). Steps with a
query longer than one token (prefill, mixed) and layers other than plain attention are left out.
"""

import json
import uuid
from pathlib import Path

import numpy as np
import torch

from pagedbench.bench.step_record import RecordedStep, read_recording

PLAIN_FIELDS = ("sliding_window", "softcap", "value_dim", "topk")  # set on a layer kind: not plain GQA


def definition_name(spec: dict) -> str:
    return f"gqa_paged_decode_h{spec['num_heads']}_kv{spec['num_kv_heads']}_d{spec['head_dim']}_ps1"


def token_indices(step: RecordedStep, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(kv_indptr, kv_indices) of a decode step: each sequence's context and new token as cache slots."""
    lengths = np.asarray(step.context_lens, dtype=np.int64) + np.asarray(step.query_lens, dtype=np.int64)
    slots = []
    for pages, length in zip(step.pages, lengths):
        needed = -(-int(length) // block_size)  # page 0 is a page: a row's trailing zeros were trimmed
        pages = np.pad(pages[:needed].astype(np.int64), (0, max(0, needed - len(pages))))
        per_token = pages.repeat(block_size) * block_size
        slots.append((per_token + np.tile(np.arange(block_size), needed))[:length])
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    return indptr.astype(np.int32), np.concatenate(slots).astype(np.int32)


def workload(step: RecordedStep, header: dict, spec: dict, key: str, out_dir: Path) -> dict:
    """One step as a workload line; its indices in `<out_dir>/blob/workloads/gqa_paged/<definition>/`
    as flashinfer-trace lays them out (`<definition>_<uuid>.safetensors`, `key` naming the uuid)."""
    from safetensors.torch import save_file

    indptr, indices = token_indices(step, header["block_size"])
    name, work_id = definition_name(spec), str(uuid.uuid5(uuid.NAMESPACE_URL, key))
    path = f"./blob/workloads/gqa_paged/{name}/{name}_{work_id}.safetensors"
    (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"kv_indptr": torch.from_numpy(indptr), "kv_indices": torch.from_numpy(indices)}, str(out_dir / path))
    axes = {"batch_size": len(step.query_lens), "num_pages": header["num_cache_blocks"] * header["block_size"]}
    axes |= {"len_indptr": len(indptr), "num_kv_indices": len(indices)}
    inputs = {name: {"type": "random"} for name in ("q", "k_cache", "v_cache")}
    inputs |= {key: {"type": "safetensors", "path": path, "tensor_key": key} for key in ("kv_indptr", "kv_indices")}
    inputs["sm_scale"] = {"type": "scalar", "value": spec["scale"]}
    work = {"uuid": work_id, "axes": axes, "inputs": inputs}
    return {"definition": definition_name(spec), "workload": work, "solution": None, "evaluation": None}


def export_flashinfer_bench(recording: str | Path, out_dir: str | Path) -> tuple[Path, int]:
    """Write `<out_dir>/workloads/gqa_paged/<definition>.jsonl` (beside the lines already there: other
    recordings' steps) and a safetensors blob per step -> (the JSONL's path, workloads written)."""
    header, steps = read_recording(recording)
    kinds = [k for k in header["layer_kinds"] if not any(k.get(f) for f in PLAIN_FIELDS) and not k.get("sinks")]
    if not kinds:
        raise ValueError(f"{recording}: no plain GQA layer to export (windows, soft-caps, sinks, latent or sparse)")
    spec, out = kinds[0], Path(out_dir)
    lines = [
        json.dumps(workload(step, header, spec, f"{Path(recording).name}#{step.index}", out))
        for step in steps
        if step.query_lens and max(step.query_lens) == 1
    ]
    path = out / "workloads" / "gqa_paged" / f"{definition_name(spec)}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    ours = {json.loads(line)["workload"]["uuid"] for line in lines}  # exported again: replaced, not doubled
    kept = [line for line in (path.read_text().splitlines() if path.is_file() else [])
            if json.loads(line)["workload"]["uuid"] not in ours]  # fmt: skip
    path.write_text("".join(line + "\n" for line in [*kept, *lines]))
    return path, len(lines)
