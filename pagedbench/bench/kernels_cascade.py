"""`kernels --variants cascade`: decodes of a group sharing a prefix, each backend timed flat and with
cascade attention (backends/cascade.py), on the same pages.

A point's axes: batch size = the group's size, context length = the shared prefix (whole pages), and
`KernelGrid.suffix_lens` = each sequence's own tokens after it (its decode token the last). Bytes are
counted as read: flat, every sequence reads its prefix and suffix; cascade, the prefix once for the
group and each suffix once (the suffix's log-sum-exp reads its keys again: counted too).
"""

from dataclasses import replace

import torch

from pagedbench.backends.cascade import with_cascade
from pagedbench.backends.registry import resolve
from pagedbench.bench.problems import place, random_problem

CASCADE = "cascade"


def cascade_spec(group: int, prefix: int, suffix: int, query_len: int) -> tuple[list[tuple[int, int]], dict]:
    """(seqs, shared) of a group: `group` sequences of prefix + suffix tokens, the last query_len new,
    sharing their first `prefix` tokens with sequence 0."""
    seqs = [(prefix + suffix - query_len, query_len)] * group
    return seqs, {b: (0, prefix) for b in range(1, group)}


def cascade_bytes(point: dict, group: int, prefix: int, suffix: int, itemsize: int, on: bool) -> int:
    """K and V bytes one forward reads: flat, group x (prefix + suffix); cascade, prefix + group x 2 x suffix
    (a suffix read by the flat pass and again for its log-sum-exp, K only: counted as K and V alike)."""
    tokens = prefix + group * 2 * suffix if on else group * (prefix + suffix)
    return 2 * tokens * point["num_kv_heads"] * point["head_dim"] * itemsize


def cascade_rows(grid_point, backends: list[str], grid, dev, dt, columns: dict, out: list, timing) -> None:
    """Each backend's two rows at a point (cascade off, on), appended to `out` as measured. `timing`:
    kernels' (shape_columns, backend_row) so the rows are timed and checked as every other point's."""
    shape_columns, backend_row = timing
    _, phase, query_len, (num_heads, num_kv_heads), block_size, prefix, group = grid_point
    for suffix in grid.suffix_lens:
        if prefix % block_size or suffix < query_len:
            continue  # a prefix of whole pages; a suffix holds the step's new tokens
        seqs, shared = cascade_spec(group, prefix, suffix, query_len)
        problem = random_problem(seqs, num_heads, num_kv_heads, grid.head_dim, dt, shared=shared)
        flat = place(problem, block_size, dev)
        cascaded = replace(flat, metadata=with_cascade(flat.metadata, True, min_members=1))
        base = {
            **columns, "variant": CASCADE, "phase": phase, "query_len": query_len, "batch_size": group,
            "context_len": prefix + suffix, "prefix_len": prefix, "suffix_len": suffix, "block_size": block_size,
            "kv_cache_dtype": "auto", "placement": "random", "batch_invariant": False,
            **shape_columns(seqs, num_heads, num_kv_heads, grid, dt),
        }  # fmt: skip
        expected = None
        for name in backends:
            found = resolve(name, dev, dt, grid.head_dim, block_size, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, cascade_attention=True)  # fmt: skip
            for on, batch in ((False, flat), (True, cascaded)):
                head = {"backend": name, "provider": found.provider, **base, "cascade": "on" if on else "off"}
                head["kv_bytes"] = cascade_bytes(head, group, prefix, suffix, dt.itemsize, on)
                head["cascade_share"] = prefix * group / (group * (prefix + suffix)) if on else 0.0
                if found.reason and (on or "cascade attention" not in found.reason):
                    out.append({**head, "status": "unavailable", "reason": found.reason})
                    continue
                if expected is None:
                    expected = _reference(flat, head, grid, dev, dt)
                out.append(backend_row(found.cls, batch, head, grid, dev, dt, expected))


def _reference(batch, head: dict, grid, dev, dt) -> torch.Tensor:
    from pagedbench.backends.reference import ReferenceBackend

    args = (head["num_heads"], head["num_kv_heads"], grid.head_dim, grid.head_dim**-0.5, head["block_size"])
    backend = ReferenceBackend(*args, dev, dt)
    return backend.forward(batch.q, batch.k_cache, batch.v_cache, backend.plan(batch.metadata))
