"""Cascade (two-level) attention: sequences whose block tables begin with the same full pages (a
prefix-cache hit, n > 1 samples forked from one prompt) read that shared prefix once per group.

How a step's groups are found (`find_groups`, from the host block table the step already has): only
decode-type rows count (at most CASCADE_MAX_QUERY new tokens: decodes, multi-token decodes,
speculative verification); a row's candidate prefix is its pages fully written before this step
(context_len // block_size). Rows are split by page id, page by page: a group keeps the pages all its
members share, or splits at the first page where they differ when its subgroups save more reads
(saved reads of a group: (members - 1) x prefix tokens). Page ids, not tokens: shared pages are
what prefix caching and forks leave behind.

When a step cascades (`EngineConfig.cascade_attention`): True: every group of two or more members;
False: never; None (the default), vLLM's `use_cascade_attention` rule: a group only where it has at
least CASCADE_MIN_GROUP members sharing at least CASCADE_MIN_PREFIX tokens; a step with none runs
flat. So a group of one (no sharing) or a short prefix never cascades by default.

How a backend runs the plan (`CascadeAttention`, the shared path): the suffix pass is the backend's
own flat forward over the step's metadata with each member's leading prefix pages cut off
(`suffix_metadata`: block table shifted, lengths shortened; causality and windows are relative, so
they hold); the prefix pass is one attention per group, the group's query rows stacked (GQA heads
packed per KV head) over the prefix read once, returning its log-sum-exp (`prefix_attention`, the
backend's kernel); the suffix's log-sum-exp is recomputed from the suffix keys (the flat kernels
return none: a second read of the suffix, never of the prefix); `merge_states` merges the two by
their log-sum-exp. Soft-caps apply in both passes; sinks only once, in the suffix pass and its
log-sum-exp; a window masks the prefix pass per query row, and a group whose prefix lies wholly
outside every member's window skips it. Prefill rows are never members: they run flat.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch
from einops import rearrange
from pagedbench.backends.base import AttentionMetadata, cap_scores, read_kv, visible

CASCADE_MAX_QUERY = 16  # new tokens of a row that may join a group (decode-type rows)
CASCADE_MIN_GROUP = 8  # the default heuristic: members of a group
CASCADE_MIN_PREFIX = 256  # the default heuristic: shared prefix tokens


@dataclass(frozen=True, slots=True)
class CascadeGroup:
    """Sequences (rows of the step) whose block tables begin with the same `prefix_pages`."""

    prefix_pages: tuple[int, ...]
    members: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """A step's groups; each member's suffix starts at its group's len(prefix_pages) * block_size."""

    groups: tuple[CascadeGroup, ...]
    block_size: int

    def prefix_len(self, group: CascadeGroup) -> int:
        return len(group.prefix_pages) * self.block_size


def find_groups(
    block_table: np.ndarray, context_lens: np.ndarray, query_lens: np.ndarray, block_size: int, min_members: int = 2
) -> list[CascadeGroup]:
    """The groups of decode-type rows sharing leading full pages (module docstring), best split."""
    full = np.where(query_lens <= CASCADE_MAX_QUERY, context_lens // block_size, 0)
    rows = np.flatnonzero(full > 0)
    if len(rows) < min_members:
        return []
    groups: list[tuple[int, np.ndarray]] = []
    _split(block_table, full, rows, 0, min_members, groups)
    return [CascadeGroup(tuple(int(p) for p in block_table[r[0], :d]), tuple(int(i) for i in r)) for d, r in groups]


def _split(table: np.ndarray, full: np.ndarray, rows: np.ndarray, depth: int, min_members: int, out: list) -> int:
    """Rows sharing table[:, :depth]: append their best groups to `out`, return the reads they save."""
    limit = int(full[rows].min())
    same = (table[rows, depth:limit] == table[rows[0], depth:limit]).all(axis=0)
    common = depth + (int(np.argmin(same)) if not same.all() else limit - depth)
    whole = (len(rows) - 1) * common
    deeper = rows[full[rows] > common]
    found, saved = [], 0
    if len(deeper) >= min_members:
        pages = table[deeper, common]
        values, counts = np.unique(pages, return_counts=True)
        for page in values[counts >= min_members]:  # (no Python loop over a batch of distinct prompts)
            saved += _split(table, full, deeper[pages == page], common + 1, min_members, found)
    if saved > whole:
        out.extend(found)
        return saved
    if common > 0:
        out.append((common, rows))
    return whole


@dataclass(slots=True)
class CascadeCounts:
    """What cascade covered over a run (reports): steps, those that cascaded, and the KV tokens read
    by decode-type query rows, in all and through a group's shared prefix (read once for the group)."""

    steps: int = 0
    cascade_steps: int = 0
    decode_kv_tokens: int = 0
    shared_kv_tokens: int = 0

    def add(self, plan: "CascadePlan | None", seq_lens: np.ndarray, query_lens: np.ndarray) -> None:
        decode = query_lens <= CASCADE_MAX_QUERY
        self.steps += 1
        self.decode_kv_tokens += int((seq_lens[decode] * query_lens[decode]).sum())
        if plan is not None:
            self.cascade_steps += 1
            self.shared_kv_tokens += sum(
                plan.prefix_len(g) * int(query_lens[m]) for g in plan.groups for m in g.members
            )

    @property
    def share(self) -> float:
        """Share of the decode rows' KV reads that cascade's prefix passes served."""
        return self.shared_kv_tokens / self.decode_kv_tokens if self.decode_kv_tokens else 0.0


def plan_cascade(
    setting: bool | None,
    block_table: np.ndarray,
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    min_members: int = 2,
) -> CascadePlan | None:
    """The step's plan under `cascade_attention` (True: groups of `min_members` or more, False, None: the
    heuristic), or None: flat."""
    if setting is False:
        return None
    if setting is None:
        eligible = (query_lens <= CASCADE_MAX_QUERY) & (context_lens >= CASCADE_MIN_PREFIX)
        if eligible.sum() < CASCADE_MIN_GROUP:  # the common case, decided without a search
            return None
        groups = find_groups(block_table, context_lens, query_lens, block_size, CASCADE_MIN_GROUP)
        groups = [g for g in groups if len(g.prefix_pages) * block_size >= CASCADE_MIN_PREFIX]
    else:
        groups = find_groups(block_table, context_lens, query_lens, block_size, min_members)
    return CascadePlan(tuple(groups), block_size) if groups else None


def merge_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over keys A and B from the results over each: out [T, H, D] and natural-log
    log-sum-exp [T, H] (-inf: no key seen); sinks [H] join the denominator here (pass them once)."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    if sinks is not None:
        top = torch.maximum(top, sinks.float())
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b + (torch.exp(sinks.float() - top) if sinks is not None else 0)
    merged = (w_a[..., None] * out_a.float() + w_b[..., None] * out_b.float()) / total[..., None]
    return merged.to(out_a.dtype)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None, seen: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit scores in fp32: q [.., R, D] over k, v [.., S, D] (seen: [.., R, S] or None) ->
    (out [.., R, D_v] fp32, lse [.., R]; -inf where a row sees nothing, its out 0)."""
    scores = cap_scores((q.float() @ k.float().transpose(-1, -2)) * scale, softcap)
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe[..., None]) @ v.float(), lse


@dataclass(slots=True)
class _GroupRows:
    rows: torch.Tensor  # [R] flat query tokens of the group's members
    q_pos: torch.Tensor  # [R] their positions
    prefix_slots: torch.Tensor  # [P] cache slots of the shared prefix
    prefix_pages: torch.Tensor  # [P / block_size] int32: its pages
    prefix_len: int


@dataclass(slots=True)
class CascadeState:
    """A backend's plan of a cascade step: its own flat plan of the suffixes, and the groups' rows."""

    flat: object
    groups: list[_GroupRows]  # those whose prefix the window (if any) still reaches: each has a prefix pass
    rows: torch.Tensor | None  # their rows, concatenated in group order (None: no group)
    suffix: AttentionMetadata  # the step's metadata with the members' prefixes cut off
    longest_suffix: int  # keys of the longest member suffix (what suffix_lse gathers per row)


def suffix_metadata(meta: AttentionMetadata, plan: CascadePlan) -> AttentionMetadata:
    """`meta` with each member's prefix pages cut off: block table shifted left, lengths shortened."""
    table, seq_lens, context_lens = meta.block_table.clone(), meta.seq_lens.clone(), meta.context_lens.clone()
    seq_cpu, ctx_cpu = list(meta.seq_lens_cpu), list(meta.context_lens_cpu)
    for g in plan.groups:
        pages, cut = len(g.prefix_pages), plan.prefix_len(g)
        rows = torch.tensor(g.members, device=table.device)
        table[rows, : table.shape[1] - pages] = meta.block_table[rows, pages:]
        seq_lens[rows] -= cut
        context_lens[rows] -= cut
        for m in g.members:
            seq_cpu[m] -= cut
            ctx_cpu[m] -= cut
    return replace(
        meta, block_table=table, seq_lens=seq_lens, context_lens=context_lens, seq_lens_cpu=seq_cpu,
        context_lens_cpu=ctx_cpu, max_seq_len=max(seq_cpu), cascade=None,
    )  # fmt: skip


class CascadeAttention:
    """The shared cascade path (module docstring). A backend that claims cascade mixes it in, plans
    through `plan_cascade_step` and forwards a CascadeState through `cascade_forward`; it may override
    `prefix_attention` with its own kernel."""

    def plan_cascade_step(self, meta: AttentionMetadata, plan_flat) -> CascadeState:
        plan, qsl, device = meta.cascade, meta.query_start_loc_cpu, meta.block_table.device
        suffix = suffix_metadata(meta, plan)
        groups = []
        for g in plan.groups:
            rows = np.concatenate([np.arange(qsl[m], qsl[m + 1]) for m in g.members])
            seqs = np.concatenate([np.full(qsl[m + 1] - qsl[m], m) for m in g.members])
            prefix_len = plan.prefix_len(g)
            slots = np.repeat(np.array(g.prefix_pages) * meta.block_size, meta.block_size)
            slots += np.tile(np.arange(meta.block_size), len(g.prefix_pages))
            as_tensor = lambda a: torch.from_numpy(a.astype(np.int64)).to(device)
            q_pos = np.asarray(meta.context_lens_cpu)[seqs] + rows - np.asarray(qsl)[seqs]
            pages = torch.tensor(g.prefix_pages, dtype=torch.int32).to(device)
            window = self.variant.sliding_window
            if window is not None and int(q_pos.min()) - window >= prefix_len - 1:
                continue  # every member's window starts past the prefix: the suffix pass is all it sees
            groups.append(_GroupRows(as_tensor(rows), as_tensor(q_pos), as_tensor(slots), pages, prefix_len))
        flat = plan_flat(suffix)
        longest = max(suffix.seq_lens_cpu[m] for g in plan.groups for m in g.members)
        rows = torch.cat([g.rows for g in groups]) if groups else None
        return CascadeState(flat, groups, rows, suffix, longest)

    def cascade_forward(self, q, k_cache, v_cache, state: CascadeState, flat_forward, sinks=None, kv_scales=None):
        """Suffix pass (the backend's `flat_forward(q, state.flat)`, sinks included), prefix passes, merge."""
        out = flat_forward(q, state.flat)
        if not state.groups:
            return out
        prefix_out, prefix_lse = zip(*(self.prefix_pass(q, k_cache, v_cache, g, kv_scales) for g in state.groups))
        suffix_lse = self.suffix_lse(q, k_cache, state, state.rows, sinks, (kv_scales or (None, None))[0])
        merged = merge_states(out.index_select(0, state.rows), suffix_lse, torch.cat(prefix_out), torch.cat(prefix_lse))
        return out.index_copy_(0, state.rows, merged)

    def prefix_pass(self, q, k_cache, v_cache, g: _GroupRows, kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's prefix pass: its prefix K/V gathered once (dequantized), then `prefix_attention`;
        a backend whose kernel reads the pages in place overrides this."""
        k_scale, v_scale = kv_scales or (None, None)
        k = read_kv(k_cache, g.prefix_slots, k_scale, q.dtype)
        latent = v_cache.data_ptr() == k_cache.data_ptr()
        v = k[..., : v_cache.shape[-1]] if latent else read_kv(v_cache, g.prefix_slots, v_scale, q.dtype)
        return self.prefix_attention(q.index_select(0, g.rows), k, v, g.q_pos)

    def prefix_attention(self, q_rows, k, v, q_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's rows q_rows [R, H, D] over its prefix k [P, H_kv, D], v [P, H_kv, D_v] (every
        prefix key precedes every row) -> (out [R, H, D_v], lse [R, H]); fp32 explicit scores here."""
        group = self.num_heads // self.num_kv_heads
        qg = rearrange(q_rows, "r (hk g) d -> hk (r g) d", g=group)
        seen = self.prefix_seen(q_pos, k.shape[0], group)
        o, lse = attention_with_lse(qg, k.transpose(0, 1), v.transpose(0, 1), self.scale, self.variant.softcap, seen)
        return rearrange(o, "hk (r g) d -> r (hk g) d", g=group), rearrange(lse, "hk (r g) -> r (hk g)", g=group)

    def prefix_seen(self, q_pos: torch.Tensor, prefix_len: int, group: int) -> torch.Tensor | None:
        """[(R G), P] which prefix keys each packed row sees under the window, or None: all."""
        if self.variant.sliding_window is None:
            return None
        kv_pos = torch.arange(prefix_len, device=q_pos.device)
        return visible(q_pos.repeat_interleave(group)[:, None], kv_pos, self.variant.sliding_window)

    def suffix_lse(self, q, k_cache, state: CascadeState, rows, sinks, k_scale) -> torch.Tensor:
        """[len(rows), H] log-sum-exp of each member row over its suffix keys (and its sink), fp32."""
        meta, group = state.suffix, self.num_heads // self.num_kv_heads
        token_seq = meta.token_seq_idx.long()[rows]
        pos = torch.arange(state.longest_suffix, device=q.device)
        pages = meta.block_table[token_seq][:, pos // meta.block_size].long()
        k = read_kv(k_cache, pages * meta.block_size + pos % meta.block_size, k_scale, torch.float32)  # [R, S, hk, d]
        q_pos = (meta.context_lens[token_seq] + rows - meta.query_start_loc[token_seq]).long()
        seen = visible(q_pos[:, None], pos, self.variant.sliding_window) & (pos < meta.seq_lens[token_seq, None])
        qg = rearrange(q[rows].float(), "r (hk g) d -> r hk g d", g=group)
        # per KV head: k[:, :, h] is a strided matrix matmul takes as it is (a head-major copy costs more)
        scores = torch.stack([qg[:, h] @ k[:, :, h].transpose(1, 2) for h in range(k.shape[2])], 1)
        scores = cap_scores(scores * self.scale, self.variant.softcap)
        lse = torch.logsumexp(scores.masked_fill(~seen[:, None, None, :], float("-inf")), dim=-1).flatten(1)
        return lse if sinks is None else torch.logaddexp(lse, sinks.float())


def with_cascade(meta: AttentionMetadata, setting: bool | None = True, min_members: int = 2) -> AttentionMetadata:
    """`meta` with the cascade plan its block table gives under `setting` (the engine plans from the
    step's host arrays; this, for problems built elsewhere: one device-to-host copy); `min_members` 1
    (checks): a sequence that shares no page is a group of its own."""
    q_lens = np.diff(np.asarray(meta.query_start_loc_cpu))
    table = meta.block_table.cpu().numpy()
    plan = plan_cascade(setting, table, np.asarray(meta.context_lens_cpu), q_lens, meta.block_size, min_members)
    return replace(meta, cascade=plan)


def cascade_setting(backends: list, setting: bool | None) -> bool | None:
    """The setting the engine plans with for these backends (every layer's): False where one has no
    cascade path and it was left to the heuristic; a ValueError with its reason where it was asked for.
    Off under batch_invariant: which sequences share a prefix pass depends on the batch."""
    if any(getattr(b, "batch_invariant", False) for b in backends):
        if setting:
            raise ValueError("cascade_attention=True cannot run with batch_invariant: a shared prefix read once per "
                             "group makes a sequence's sums depend on the batch")  # fmt: skip
        return False
    lacking = [b for b in backends if not b.cascade_attention]
    if not lacking:
        if setting is None and any(b.cascade_not_by_default for b in backends):
            return False  # the heuristic leaves a backend measured slower with it flat (asked for, it runs)
        return setting
    if setting:
        name, reason = lacking[0].name, lacking[0].cascade_reason(True)
        raise ValueError(f"backend {name!r} cannot run cascade_attention=True: {reason}")
    return False
