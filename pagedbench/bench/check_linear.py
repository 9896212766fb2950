"""`pagedbench check`'s gated DeltaNet cases: a hybrid model's linear-attention layer (GatedDeltaNet:
the causal conv window and the gated delta rule) fed as the engine feeds it -- ragged flat batches,
states continued in their slots from step to step, snapshots cut by prefix caching -- through each
linear_attention_kernel, against a float64 token-by-token oracle of every sequence.

Tolerance, as the attention cases derive it: TOLERANCE_FACTOR x the error of the same oracle
computed in the case's dtype (its state included), plus the dtype's floor.
"""

import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pagedbench.backends.base import one_line
from pagedbench.bench.check import TOLERANCE_FACTOR, TOLERANCE_FLOOR
from pagedbench.config import LINEAR_ATTENTION_KERNELS
from pagedbench.device.dtypes import dtype_name

LINEAR_PREFIX = "gdn-"  # check's names of these cases' kernels: gdn-torch, gdn-fla (beside attention backends')
KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_KERNEL, HIDDEN = 2, 4, 16, 4, 32  # value heads grouped over key heads
NUM_SLOTS = 8  # a slot per sequence (its index), snapshots in the slots after


@dataclass(slots=True)
class LinearCase:
    """Sequences of `lengths` tokens run through `steps` (each: sequence -> tokens it computes that
    step, in the flat batch in sequence order). `cuts`: (step, sequence) -> [(rows into its chunk,
    snapshot slot)], prefix caching's snapshots. `resumes`: sequence -> (source sequence, its
    prefix tokens, snapshot slot): a prefix hit, restored from the snapshot, whose rows are
    checked from the prefix on."""

    batch: str
    lengths: list[int]
    steps: list[dict[int, int]]
    dtype: torch.dtype = torch.float32
    cuts: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    resumes: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"gated deltanet {self.batch} {KEY_HEADS}/{VALUE_HEADS} heads d{HEAD_DIM} {dtype_name(self.dtype)}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.batch.encode())


def build_linear_cases(dtypes: list[torch.dtype]) -> list[LinearCase]:
    """(a) chunked prefill: two prompts over two steps, the second chunk continuing each state, one
    of them cut by a snapshot that a third prompt then resumes from; (b) single-token decodes after
    ragged prompts; (c) a ragged batch: a decode, a continued chunk, a fresh prompt and a fresh
    one-token prompt in one step. The same few cases in --quick and --full."""
    cases = []
    for dtype in dtypes:
        cases += [
            LinearCase(
                "chunked prefill",
                [45, 30, 10],
                [{0: 20, 1: 20}, {0: 25, 1: 10}, {2: 10}],
                dtype,
                cuts={(1, 0): [(7, 5)]},  # seq 0's state after 27 tokens -> slot 5
                resumes={2: (0, 27, 5)},
            ),
            LinearCase("decode", [4, 9, 17], [{0: 2, 1: 7, 2: 15}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}], dtype),
            LinearCase("ragged batch", [10, 15, 5, 1], [{0: 9, 1: 2}, {0: 1, 1: 13, 2: 5, 3: 1}], dtype),
        ]
    return cases


def linear_config(
    key_heads: int = KEY_HEADS, value_heads: int = VALUE_HEADS, head_dim: int = HEAD_DIM, hidden: int = HIDDEN
) -> SimpleNamespace:
    """A one-layer DeltaNet model config (what GatedDeltaNet and LinearStateCache read): the check's
    tiny one by default."""
    from pagedbench.model.config import LinearAttention

    lin = LinearAttention(key_heads, value_heads, head_dim, head_dim, CONV_KERNEL, (True,), "split")
    return SimpleNamespace(linear=lin, hidden_size=hidden, rms_norm_eps=1e-6, is_linear_layer=lambda i: True)


def linear_layer(seed: int, device: torch.device, dtype: torch.dtype, cfg=None):
    """A GatedDeltaNet with N(0, 0.3) weights (decays and gates far from trivial)."""
    from pagedbench.model.hybrid import GatedDeltaNet

    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg or linear_config(), 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.to(device, dtype).eval()


def delta_rule_oracle(layer, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """One sequence through a GatedDeltaNet layer token by token in `dtype` (on the CPU), from a zero
    state: conv over the last K inputs, SiLU, L2-normed q/k (q scaled by 1/sqrt(Dk)), value heads
    grouped over key heads, S <- exp(g) S + k (beta (v - S^T k))^T, o = S^T q, then the gated
    RMSNorm and out_proj. The projections are the layer's own, in its dtype."""
    lin = layer.lin
    w = {n: p.detach().to("cpu", dtype) for n, p in layer.named_parameters()}
    param = next(layer.parameters())
    with torch.no_grad():
        projected = layer._project(x.to(param.device, param.dtype))
    mixed, z, b, a = (t.to("cpu", dtype) for t in projected)
    conv = w["conv1d.weight"][:, 0]  # [C, K]
    padded = torch.cat([torch.zeros(lin.conv_kernel - 1, mixed.shape[1], dtype=dtype), mixed])
    state = torch.zeros(lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, dtype=dtype)
    group = lin.num_value_heads // lin.num_key_heads
    outs = []
    for t in range(x.shape[0]):
        y = F.silu((padded[t : t + lin.conv_kernel].T * conv).sum(-1))
        q, k, v = y.split([lin.key_dim, lin.key_dim, lin.value_dim])
        q = F.normalize(q.view(-1, lin.key_head_dim), dim=-1).repeat_interleave(group, 0)
        k = F.normalize(k.view(-1, lin.key_head_dim), dim=-1).repeat_interleave(group, 0)
        q = q / lin.key_head_dim**0.5
        v = v.view(-1, lin.value_head_dim)
        beta = b[t].sigmoid()
        g = -w["A_log"].exp() * F.softplus(a[t] + w["dt_bias"])
        state = state * g.exp()[:, None, None]
        delta = (v - torch.einsum("hkv,hk->hv", state, k)) * beta[:, None]
        state = state + torch.einsum("hk,hv->hkv", k, delta)
        o = torch.einsum("hkv,hk->hv", state, q)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm.eps)
        outs.append((w["norm.weight"] * normed * F.silu(z[t])).reshape(-1))
    return torch.stack(outs) @ w["out_proj.weight"].T


def case_inputs(case: LinearCase) -> list[torch.Tensor]:
    """Each sequence's whole input [tokens, hidden] (fp32, CPU): a resumed one starts with its
    source's prefix."""
    gen = torch.Generator().manual_seed(case.seed)
    own = [torch.randn(n, HIDDEN, generator=gen) for n in case.lengths]
    for seq, (src, prefix, _) in case.resumes.items():
        own[seq] = torch.cat((own[src][:prefix], own[seq]))
    return own


def run_steps(layer, case: LinearCase, xs: list[torch.Tensor], kernel: str, device: torch.device) -> list:
    """Each sequence's output rows [tokens it computed, hidden], through the engine's step views:
    one LinearStep per step over a LinearStateCache whose kernel is `kernel`."""
    from pagedbench.model.layers import AttentionContext
    from pagedbench.worker.linear_state import LinearStateCache, LinearStep

    dtype = next(layer.parameters()).dtype
    cfg = SimpleNamespace(linear=layer.lin, is_linear_layer=lambda i: True)
    cache = LinearStateCache.allocate(cfg, [0], NUM_SLOTS, device, dtype)
    cache.kernel = kernel
    done = [0] * len(xs)
    outs = [[] for _ in xs]
    for s, step in enumerate(case.steps):
        seqs = sorted(step)
        for seq in seqs:
            if seq in case.resumes and not done[seq]:  # a prefix hit: the slot restored from the snapshot
                _, prefix, snapshot = case.resumes[seq]
                cache.copy([(snapshot, seq)])
                done[seq] = prefix
        x = torch.cat([xs[i][done[i] : done[i] + step[i]] for i in seqs]).to(device, dtype)
        qsl = [0]
        for i in seqs:
            qsl.append(qsl[-1] + step[i])
        cuts = [case.cuts.get((s, i), []) for i in seqs]
        linear = LinearStep(cache, seqs, qsl, [done[i] for i in seqs], cuts)
        with torch.no_grad():
            out = layer(x, AttentionContext([], [], None, [], linear=linear))
        for j, i in enumerate(seqs):
            outs[i].append(out[qsl[j] : qsl[j + 1]].to("cpu", torch.float64))
            done[i] += step[i]
    return [torch.cat(o) for o in outs]


def run_linear_case(case: LinearCase, kernels: list[str], device: torch.device) -> list[dict]:
    """One row per kernel: max and mean abs error of every computed row against the float64
    oracle, and the verdict against the case's tolerance."""
    from pagedbench.model.delta_rule import fla_unavailable_reason, kernel_provider

    layer = linear_layer(case.seed, device, case.dtype)
    xs = case_inputs(case)
    first = [case.resumes[i][1] if i in case.resumes else 0 for i in range(len(xs))]  # rows checked from here
    expected = [delta_rule_oracle(layer, x)[r:] for x, r in zip(xs, first)]
    naive = [delta_rule_oracle(layer, x, case.dtype)[r:].double() for x, r in zip(xs, first)]
    noise = max(float((n - e).abs().max()) for n, e in zip(naive, expected))
    tol = TOLERANCE_FACTOR * noise + TOLERANCE_FLOOR[case.dtype]
    head = {
        "case": case.name,
        "batch": case.batch,
        "heads": f"GDN {KEY_HEADS}/{VALUE_HEADS}",
        "num_heads": VALUE_HEADS,
        "num_kv_heads": KEY_HEADS,  # key heads: each serves VALUE_HEADS / KEY_HEADS value heads
        "head_dim": HEAD_DIM,
        "dtype": dtype_name(case.dtype),
        "variant": "gated delta rule + conv",
        "num_seqs": len(xs),
        "num_query_tokens": sum(case.lengths),
        "tolerance": tol,
    }
    rows = []
    for kernel in kernels:
        row = {**head, "backend": LINEAR_PREFIX + kernel, "linear_attention_kernel": kernel}
        reason = fla_unavailable_reason(device.type) if kernel == "fla" else None
        if reason:
            rows.append({**row, "provider": "", "status": "skipped", "reason": reason})
            continue
        row["provider"] = kernel_provider(kernel, device)
        try:
            got = run_steps(layer, case, xs, kernel, device)
        except Exception as e:  # a kernel that raises fails this case; the others go on
            rows.append({**row, "status": "fail", "reason": f"raised {one_line(e)}"})
            continue
        errors = torch.cat([(g - e).abs().flatten() for g, e in zip(got, expected)])
        row.update(max_abs_error=float(errors.max()), mean_abs_error=float(errors.mean()))
        why = []
        if not bool(torch.isfinite(errors).all()):
            why.append("non-finite output")
        if row["max_abs_error"] > tol:
            why.append(f"error {row['max_abs_error']:.3g} > tolerance {tol:.3g}")
        rows.append({**row, "status": "fail" if why else "pass", "reason": "; ".join(why)})
    return rows


def linear_kernel_names() -> list[str]:
    """Every kernel under its check name."""
    return [LINEAR_PREFIX + kernel for kernel in LINEAR_ATTENTION_KERNELS]


def split_backends(names: list[str]) -> tuple[list[str], list[str]]:
    """(attention backends, linear-attention kernels) among check's names; ValueError for a gdn- name
    that is no kernel."""
    kernels = [name.removeprefix(LINEAR_PREFIX) for name in names if name.startswith(LINEAR_PREFIX)]
    for kernel in kernels:
        if kernel not in LINEAR_ATTENTION_KERNELS:
            known = ", ".join(linear_kernel_names())
            raise ValueError(f"unknown linear-attention kernel {LINEAR_PREFIX}{kernel}; known: {known}")
    return [name for name in names if not name.startswith(LINEAR_PREFIX)], kernels


def run_linear_check(kernels: list[str], device: torch.device, dtypes: list[torch.dtype]) -> list[dict]:
    """Every gated DeltaNet case for each of `kernels`."""
    return [row for case in build_linear_cases(dtypes) for row in run_linear_case(case, kernels, device)]
