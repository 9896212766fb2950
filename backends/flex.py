"""FlexAttention over the paged cache, each query block reading only its own sequence's pages.

Per layer the cache `[num_pages, block_size, H_kv, D]` is viewed (no copy) as keys
`[1, H_kv, num_pages * block_size, D]`. A step runs up to two flex calls, sharing one prepare():

- decode call: sequences with at most MAX_DECODE_QUERY new tokens (decodes, and short multi-token
  decodes), queries `[B, H, Q, D]` (Q = 1, 2, 4 or 8; short rows repeat their last token) against
  the cache as batch 1, which flex broadcasts. Row b of the BlockMask lists exactly sequence b's
  pages: those every query of the row sees whole as full blocks (no mask_mod), the rest masked.
- prefill call: longer chunks as one flat row `[1, H, T', D]`, each chunk padded to whole query
  blocks so a block never mixes sequences; block r lists its sequence's pages up to its last query.

One mask_mod rule for both: a key slot is visible if it is in the query's own sequence at a
logical position <= the query's. An inverse page table `inv[seq, physical page]` (logical page,
or -1), rewritten where it changed each step, answers it without any global page->sequence map,
so pages shared by several sequences (prefix caching, forks) are right, and stale table entries
past a sequence's length are never visible.

Compilation: one `torch.compile(dynamic=True)` function; the mask_mod's buffers have static
power-of-two capacities (dynamic sizes in them break the CPU kernel's codegen), so a graph is
compiled per (call kind, heads, head_dim, dtype, page size, capacity bucket); on CUDA the decode
batch is a static power of two, as flex's decoding kernel needs. `compile_stats` counts graphs.
`compile=False` or PAGEDBENCH_FLEX_COMPILE=0 runs flex eager (it materializes all scores).
PAGEDBENCH_FLEX_KERNEL=flash runs the prefill call on FlexAttention's FA4-based kernels (CUDA,
with flash-attn-4 installed, a torch whose flex has BACKEND='FLASH') instead of Triton; decodes
stay on flex's Triton decoding kernel (FLASH wants K/V batch == query batch).
"""

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange
from pagedbench.backends.base import AttentionBackend, AttentionMetadata
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pagedbench.device.transfer import to_device

logger = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1
MAX_DECODE_QUERY = 8  # sequences with at most this many new tokens take the per-sequence decode call
MIN_ROW_CAPACITY = 64
MIN_TOKEN_CAPACITY = 1024
MIN_PAGE_CAPACITY = 1024
MIN_KV_BLOCK = 16
RECOMPILE_LIMIT = 256
compile_stats = {"graphs": 0}  # graphs compiled by this process (each one is a recompile of `_attend`)
_announced: set[str] = set()  # call kinds whose first compile this process has announced


def _attend(q, k, v, block_mask: BlockMask, scale: float, kernel_options: dict | None):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)


def _inductor_counting(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    compile_stats["graphs"] += 1
    return compile_fx(gm, example_inputs)


_attend_compiled = torch.compile(_attend, backend=_inductor_counting, fullgraph=True, dynamic=True)


def _attend_fused(*args):
    """Compiled `_attend`. Past the recompile limit dynamo would silently run flex's unfused eager
    path instead; here that raises. Sizes equal by chance must not become guards (duck shapes)."""
    with (
        torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True, specialize_float=True
        ),
        torch.fx.experimental._config.patch(use_duck_shape=False),
    ):
        return _attend_compiled(*args)


def _capacity(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def _index_in_group(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: 0..counts[i]-1 for each group i, concatenated."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass(slots=True)
class FlexCall:
    """One flex call of a step: which flat query tokens it takes, in what shape, and its BlockMask."""

    kind: str  # "decode" | "prefill"
    batch: int  # flex batch: decode rows, or 1
    q_len: int  # query rows per batch entry
    gather: torch.Tensor | None  # [batch * q_len] flat token of each query row; None: tokens 0..batch*q_len-1
    real: torch.Tensor | None  # [K] query rows that are real tokens (the rest repeat one), None: all
    dest: torch.Tensor | None  # [K] the flat token each real row answers
    real_rows: np.ndarray  # [mask rows] real query rows in each BlockMask row (tile efficiency)
    block_mask: BlockMask | None = None


@dataclass(slots=True)
class FlexState:
    calls: list[FlexCall]
    num_tokens: int
    shapes_seen: bool = False  # after the step's first layer every layer hits the same compiled graphs


class _Entries:
    """(mask row, logical page) pairs a call reads, split into full and masked blocks; host arrays."""

    def __init__(
        self, row_seq: np.ndarray, first_pos: np.ndarray, last_pos: np.ndarray, block_size: int, all_masked: bool
    ):
        pages = np.where(last_pos >= 0, last_pos // block_size + 1, 0)  # pages up to the row's last query
        # Pages wholly at or before the row's first query position: every query of the row sees them.
        self.num_full = np.zeros_like(pages) if all_masked else np.minimum((first_pos + 1) // block_size, pages)
        self.row = np.repeat(np.arange(len(row_seq)), pages)
        self.seq = row_seq[self.row]
        self.logical = _index_in_group(pages)
        self.full = self.logical < self.num_full[self.row]
        self.col = np.where(self.full, self.logical, self.logical - self.num_full[self.row])
        self.num_masked = pages - self.num_full


class _Plan:
    """One call's layout on the host: flex batch and query length, and the index arrays that go to
    the device in the step's single copy (`host`, in the order `_build_call` unpacks them)."""

    def __init__(
        self,
        kind: str,
        batch: int,
        q_len: int,
        identity: bool,
        rows: int,
        real_rows: np.ndarray,
        token: np.ndarray,
        real: np.ndarray,
        seq_of: np.ndarray,
        pos: np.ndarray,
        entries: _Entries,
    ):
        self.kind, self.batch, self.q_len, self.identity = kind, batch, q_len, identity
        self.rows, self.real_rows = rows, real_rows  # BlockMask rows; real query rows in each
        e = entries
        self.host = [
            token,
            np.flatnonzero(real),
            token[real],
            seq_of,
            pos,  # query rows
            e.row,
            e.seq,
            e.logical,
            e.full.astype(np.int64),
            e.col,
            e.num_full,
            e.num_masked,
        ]


class FlexBackend(AttentionBackend):
    name = "flex"
    # A decode step padded to a power of two is one identity call whose BlockMask, inverse page
    # table and positions are views of persistent buffers that prepare() refills in place.
    cuda_graph_reason = None
    cuda_graph_powers_of_two = True

    def __init__(
        self,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        block_size,
        device,
        dtype,
        compile: bool = True,
        q_block_size: int | None = None,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype)
        self.compiled = compile and _compile_enabled()
        # Triton wants query tiles of 64+ rows; the CPU kernel is compute bound and takes short ones.
        self.q_block_size = q_block_size or (128 if self.device.type == "cuda" else 16)
        # KV blocks under 16 slots miscompute on CPU (torch 2.13's micro-GEMM N tail) and are below
        # Triton's minimum tile, so small pages share a KV block; the mask_mod maps each slot to its page.
        self.kv_block_size = max(block_size, MIN_KV_BLOCK)
        cuda = self.device.type == "cuda"
        # Triton tiles must divide the mask's blocks. FlexAttention's FA4 kernels (BACKEND=FLASH) take
        # only the prefill call: they need K/V batch == query batch, and the decode call broadcasts a
        # batch-1 cache to B query rows.
        triton_prefill = {
            "BACKEND": "TRITON",
            "BLOCK_M": min(64, self.q_block_size),
            "BLOCK_N": min(64, self.kv_block_size),
        }
        self.kernel_options = {
            "decode": {"BLOCK_N": min(64, self.kv_block_size)} if cuda else None,
            "prefill": ({"BACKEND": "FLASH"} if _kernel_choice() == "flash" else triton_prefill) if cuda else None,
        }
        # The page size must be a compile-time constant in the mask_mod (a captured int would become a
        # dynamic symbol): it is the static length of this marker tensor.
        self._page = torch.empty(block_size, dtype=torch.int8, device=self.device)
        torch._dynamo.mark_static(self._page)
        # flex's decoding kernel splits a row's KV blocks across thread blocks only when the mask has no
        # full blocks (with full blocks it splits the whole cache length), so on CUDA decodes are all masked.
        self.decode_full_blocks = not cuda
        self.static_decode_batch = cuda  # flex's decoding kernel needs a static batch
        self._buffers: dict[str, torch.Tensor] = {}
        self._inv_written: tuple[torch.Tensor, ...] | None = None  # (inv, seq, page) entries of the last step

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs):
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"flex backend runs on cpu and cuda, not {device.type}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"flex attention supports float32/bfloat16/float16, not {dtype}"
        if block_size & (block_size - 1):
            return f"block_size {block_size} must be a power of two (a BlockMask KV block holds whole pages)"
        try:
            kernel = _kernel_choice()
        except ValueError as e:
            return str(e)
        if kernel == "flash":
            reason = _flash_kernel_reason(device)
            if reason:
                return f"PAGEDBENCH_FLEX_KERNEL=flash: {reason}"
            if block_size < MIN_KV_BLOCK:
                return (
                    f"PAGEDBENCH_FLEX_KERNEL=flash: pages of {block_size} share KV blocks, "
                    "leaving no full blocks, which FLASH needs"
                )
        if device.type == "cpu" and _compile_enabled():
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

            if not check_cpu_supported():
                return "compiled flex on CPU needs x86 with AVX2 (PAGEDBENCH_FLEX_COMPILE=0 runs it eager)"
        return None

    @classmethod
    def provider(cls, **settings) -> str:
        mode = "compiled" if _compile_enabled() else "eager"
        device = settings.get("device")
        try:
            flash = _kernel_choice() == "flash" and (device is None or torch.device(device).type == "cuda")
        except ValueError:
            flash = False
        return f"torch {torch.__version__} flex {mode}" + (", FA4 prefill kernels (BACKEND=FLASH)" if flash else "")

    # --- prepare: once per step ----------------------------------------------------------------

    def _buffer(self, name: str, shape: tuple[int, ...], fill: int = 0) -> torch.Tensor:
        """A persistent int32 buffer of at least `shape`, reallocated (filled) only to grow."""
        buf = self._buffers.get(name)
        if buf is None or any(have < want for have, want in zip(buf.shape, shape)):
            if buf is not None:
                shape = tuple(max(have, want) for have, want in zip(buf.shape, shape))
            buf = torch.full(shape, fill, dtype=torch.int32, device=self.device)
            torch._dynamo.mark_static(buf)
            self._buffers[name] = buf
        return buf

    @torch.inference_mode()  # the mask's tensors must be alike whether built here or in forward (guards)
    def prepare(self, meta: AttentionMetadata) -> FlexState:
        bs = self.block_size
        num_pages = meta.num_cache_blocks
        if num_pages * bs > _INT32_MAX:
            raise ValueError(f"cache of {num_pages} x {bs} slots exceeds int32, the type of flex's kv_idx")
        if self.device.type == "cuda" and num_pages * bs * self.num_kv_heads * self.head_dim > _INT32_MAX:
            raise ValueError(f"a layer's cache of {num_pages} pages overflows Triton flex's int32 element offsets")
        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        q_lens = np.diff(qsl)
        seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        ctx = np.asarray(meta.context_lens_cpu, dtype=np.int64)
        short = q_lens <= MAX_DECODE_QUERY
        plans = [
            plan
            for plan in (
                self._plan_decode(np.flatnonzero(short), qsl, ctx),
                self._plan_prefill(np.flatnonzero(~short), qsl, ctx),
            )
            if plan is not None
        ]
        # One host-to-device copy carries every index array of the step.
        seq_pages = -(-seq_lens // bs)
        inv_seq = np.repeat(np.arange(len(seq_lens)), seq_pages)
        arrays = [inv_seq, _index_in_group(seq_pages)]
        for plan in plans:
            arrays += plan.host
        dev = to_device(np.concatenate(arrays), self.device).split([len(a) for a in arrays])
        self._fill_inverse(meta, dev[0], dev[1], len(seq_lens), num_pages)
        calls, offset = [], 2
        for plan in plans:
            count = len(plan.host)
            calls.append(self._build_call(plan, dev[offset : offset + count], meta, num_pages))
            offset += count
        return FlexState(calls, meta.num_tokens)

    def _fill_inverse(
        self, meta: AttentionMetadata, seq: torch.Tensor, logical: torch.Tensor, num_seqs: int, num_pages: int
    ) -> None:
        """inv[s, page] = logical page of `page` in sequence s, -1 elsewhere. Only the last step's
        entries are reset, so the cost follows the block tables, not the cache size."""
        inv = self._buffer(
            "inv", (_capacity(num_seqs, MIN_ROW_CAPACITY), _capacity(num_pages, MIN_PAGE_CAPACITY)), fill=-1
        )
        if self._inv_written is not None and self._inv_written[0] is inv:  # a regrown table starts all -1
            inv[self._inv_written[1], self._inv_written[2]] = -1
        pages = meta.block_table[seq, logical].long()
        inv[seq, pages] = logical.to(torch.int32)
        self._inv_written = (inv, seq, pages)

    def _plan_decode(self, seqs: np.ndarray, qsl: np.ndarray, ctx: np.ndarray) -> "_Plan | None":
        """Rows of the per-sequence decode call: host index arrays, before the device copy."""
        if not len(seqs):
            return None
        q_lens = qsl[seqs + 1] - qsl[seqs]
        q_len = 1 << int(q_lens.max() - 1).bit_length()  # 1, 2, 4 or 8
        batch = max(len(seqs), 2)  # a batch of 1 would compile a graph of its own
        if self.static_decode_batch:
            batch = 1 << (batch - 1).bit_length()
        rows = np.concatenate([seqs, np.full(batch - len(seqs), seqs[0])])  # spare rows repeat the first
        q_lens = np.concatenate([q_lens, np.zeros(batch - len(seqs), dtype=np.int64)])
        offset = np.minimum(np.arange(q_len)[None, :], np.maximum(q_lens, 1)[:, None] - 1)  # [batch, q_len]
        token = qsl[rows][:, None] + offset
        pos = ctx[rows][:, None] + offset
        spare = q_lens == 0  # spare rows read no page
        first_pos = np.where(spare, -1, ctx[rows])
        last_pos = np.where(spare, -1, ctx[rows] + q_lens - 1)
        entries = _Entries(
            rows,
            first_pos,
            last_pos,
            self.block_size,
            self.kv_block_size != self.block_size or not self.decode_full_blocks,
        )
        identity = q_len == 1 and len(seqs) == batch and np.array_equal(seqs, np.arange(batch)) and qsl[batch] == batch
        real = (np.arange(q_len)[None, :] < q_lens[:, None]).reshape(-1)
        return _Plan(
            "decode", batch, q_len, identity, len(rows), q_lens, token.reshape(-1), real, rows, pos.reshape(-1), entries
        )

    def _plan_prefill(self, seqs: np.ndarray, qsl: np.ndarray, ctx: np.ndarray) -> "_Plan | None":
        """Query blocks of the flat prefill call, each within one sequence's chunk."""
        if not len(seqs):
            return None
        qb = self.q_block_size
        q_lens = qsl[seqs + 1] - qsl[seqs]
        blocks = -(-q_lens // qb)
        block_seq = np.repeat(seqs, blocks)
        block_q0 = _index_in_group(blocks) * qb  # first query offset of each block in its chunk
        block_real = np.minimum(qb, np.repeat(q_lens, blocks) - block_q0)
        num_rows = len(block_seq) + 1  # plus an empty row: never a size-1 dimension
        first_pos = np.append(ctx[block_seq] + block_q0, -1)
        last_pos = np.append(ctx[block_seq] + block_q0 + block_real - 1, -1)
        row_seq = np.append(block_seq, seqs[0])
        entries = _Entries(row_seq, first_pos, last_pos, self.block_size, self.kv_block_size != self.block_size)
        # Query rows: block r's rows are offsets block_q0[r] + 0..qb-1, past the chunk repeating its last token.
        offset = block_q0[:, None] + np.arange(qb)[None, :]
        real = (offset < np.repeat(q_lens, blocks)[:, None]).reshape(-1)
        offset = np.minimum(offset, np.repeat(q_lens, blocks)[:, None] - 1)
        token = (qsl[block_seq][:, None] + offset).reshape(-1)
        pos = (ctx[block_seq][:, None] + offset).reshape(-1)
        seq_of_row = np.repeat(block_seq, qb)
        return _Plan(
            "prefill", 1, len(token), False, num_rows, np.append(block_real, 0), token, real, seq_of_row, pos, entries
        )

    def _build_call(self, plan: "_Plan", dev: list[torch.Tensor], meta: AttentionMetadata, num_pages: int) -> FlexCall:
        token, real, dest, seq_of, pos, e_row, e_seq, e_logical, e_full, e_col, num_full, num_masked = dev
        kind, bs, kv_block, rows = plan.kind, self.block_size, self.kv_block_size, plan.rows
        cap_rows = _capacity(rows, MIN_ROW_CAPACITY)
        # kv_indices as wide as the cache's KV-block count (flex takes the count from the last dim).
        width = _capacity(-(-num_pages * bs // kv_block) + 1, MIN_PAGE_CAPACITY)
        counts = self._buffer(f"{kind}_counts", (2, cap_rows))
        tables = self._buffer(f"{kind}_tables", (2, cap_rows, width))
        pages = meta.block_table[e_seq, e_logical]
        if kv_block == bs:  # a sequence's pages are distinct: scatter them into their columns
            counts[0, :rows].copy_(num_masked)
            counts[1, :rows].copy_(num_full)
            tables[e_full, e_row, e_col] = pages
            full_num = counts[1, :rows].view(rows, 1, 1) if kind == "decode" else counts[1, :rows].view(1, 1, rows)
            full_idx = (
                tables[1, :rows].view(rows, 1, 1, -1) if kind == "decode" else tables[1, :rows].view(1, 1, rows, -1)
            )
            if kind == "decode" and not self.decode_full_blocks:
                full_num = full_idx = None
        else:  # pages of one row may share a KV block: list each block once, without a device sync
            listed = torch.zeros(rows, tables.shape[-1], dtype=torch.bool, device=self.device)
            listed[e_row, pages.long() // (kv_block // bs)] = True
            counts[0, :rows].copy_(listed.sum(-1, dtype=torch.int32))
            column = torch.where(listed, listed.cumsum(-1) - 1, tables.shape[-1] - 1)
            blocks = torch.arange(tables.shape[-1], dtype=torch.int32, device=self.device).expand(rows, -1)
            tables[0, :rows].zero_().scatter_(1, column, blocks)
            full_num = full_idx = None
        kv_num = counts[0, :rows].view(rows, 1, 1) if kind == "decode" else counts[0, :rows].view(1, 1, rows)
        kv_idx = tables[0, :rows].view(rows, 1, 1, -1) if kind == "decode" else tables[0, :rows].view(1, 1, rows, -1)
        inv, page = self._buffers["inv"], self._page
        if kind == "decode":
            dec_seq = self._buffer("decode_seq", (cap_rows,))
            dec_seq[:rows].copy_(seq_of)
            dec_pos = self._buffer("decode_pos", (cap_rows, MAX_DECODE_QUERY))
            dec_pos[:rows, : plan.q_len].copy_(pos.view(rows, -1))

            def visible(b, h, q_idx, kv_idx):
                bs = page.shape[0]  # static: a constant in the compiled kernel
                logical = inv[dec_seq[b], kv_idx // bs]
                return (logical >= 0) & (logical * bs + kv_idx % bs <= dec_pos[b, q_idx])
        else:
            pre_seq = self._buffer("prefill_seq", (_capacity(len(seq_of), MIN_TOKEN_CAPACITY),))
            pre_seq[: len(seq_of)].copy_(seq_of)
            pre_pos = self._buffer("prefill_pos", (_capacity(len(pos), MIN_TOKEN_CAPACITY),))
            pre_pos[: len(pos)].copy_(pos)

            def visible(b, h, q_idx, kv_idx):
                bs = page.shape[0]
                logical = inv[pre_seq[q_idx], kv_idx // bs]
                return (logical >= 0) & (logical * bs + kv_idx % bs <= pre_pos[q_idx])

        identity = plan.identity
        call = FlexCall(
            kind,
            plan.batch,
            plan.q_len,
            None if identity else token,
            None if identity else real,
            None if identity else dest,
            plan.real_rows,
        )
        call.block_mask = BlockMask.from_kv_blocks(
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=(self.q_block_size, kv_block),
            mask_mod=visible,
            seq_lengths=(plan.q_len, num_pages * bs),
            compute_q_blocks=False,
        )
        return call

    # --- forward: once per layer ---------------------------------------------------------------

    def forward(self, q, k_cache, v_cache, state: FlexState) -> torch.Tensor:
        # [num_pages, bs, H_kv, D] -> [1, H_kv, num_pages * bs, D]: a view; flex takes any strides
        # with a unit last dim, and the CPU kernel reads this [B, L, H, D] layout natively.
        k = rearrange(k_cache, "n p h d -> 1 h (n p) d")
        v = rearrange(v_cache, "n p h d -> 1 h (n p) d")
        out = None
        for call in state.calls:
            rows = q[: call.batch * call.q_len] if call.gather is None else q.index_select(0, call.gather)
            x = rearrange(rows, "(b q) h d -> b h q d", b=call.batch)
            if call.kind == "decode" and self.static_decode_batch:
                torch._dynamo.mark_static(x, 0)
            y = rearrange(self._attend(x, k, v, call, state), "b h q d -> (b q) h d")
            if call.gather is None and len(state.calls) == 1:
                state.shapes_seen = True
                return y
            if out is None:
                out = q.new_empty(state.num_tokens, self.num_heads, self.head_dim)
            if call.gather is None:
                out[: y.shape[0]] = y
            else:
                out.index_copy_(0, call.dest, y.index_select(0, call.real))
        state.shapes_seen = True
        return out

    def _attend(self, x, k, v, call: FlexCall, state: FlexState) -> torch.Tensor:
        args = (x, k, v, call.block_mask, self.scale, self.kernel_options[call.kind])
        if not self.compiled:
            return _attend(*args)
        if state.shapes_seen:  # only the step's first layer can miss the compile cache
            return _attend_compiled(*args)
        if call.kind not in _announced:
            logger.info("flex: the first %s call compiles its kernel (tens of seconds on a CPU)", call.kind)
            _announced.add(call.kind)
        graphs, start = compile_stats["graphs"], time.perf_counter()
        y = _attend_fused(*args)
        if compile_stats["graphs"] != graphs:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            logger.info("flex: compiled a %s graph in %.1f s", call.kind, seconds)
        return y

    # --- diagnostics ---------------------------------------------------------------------------

    @torch.inference_mode()
    def tile_efficiency(self, state: FlexState) -> float:
        """Share of the computed score entries the mask keeps, over real query rows: for each BlockMask
        row, its real query rows x (full blocks x kv_block + kept slots of its masked blocks), over
        its real query rows x (full + masked blocks) x kv_block; from the BlockMasks as built."""
        kept = computed = 0
        kv_block = self.kv_block_size
        for call in state.calls:
            mask = call.block_mask
            rows = len(call.real_rows)
            masked = mask.kv_num_blocks.reshape(-1)[:rows].long().cpu()
            full = (
                mask.full_kv_num_blocks.reshape(-1)[:rows].long().cpu()
                if mask.full_kv_num_blocks is not None
                else torch.zeros(rows, dtype=torch.long)
            )
            real = torch.as_tensor(call.real_rows, dtype=torch.long)
            computed += int((real * (masked + full)).sum()) * kv_block
            kept += int((real * full).sum()) * kv_block
            # Masked blocks: evaluate the mask_mod on every (real query, slot) pair of every listed block.
            if not int(masked.sum()):
                continue
            row = torch.repeat_interleave(torch.arange(rows), masked)
            column = torch.from_numpy(_index_in_group(masked.numpy()))
            block = mask.kv_indices.reshape(rows, -1).cpu()[row, column].long()
            slot = block[:, None, None] * kv_block + torch.arange(kv_block)  # [E, 1, kv_block]
            q_in_row = torch.arange(int(real.max()))[None, :, None]  # [1, Q, 1]
            if call.kind == "decode":
                b, q_idx = row[:, None, None], q_in_row
            else:
                b, q_idx = torch.zeros(1, dtype=torch.long), row[:, None, None] * self.q_block_size + q_in_row
            h = torch.zeros(1, dtype=torch.long)
            keep = mask.mask_mod(*(t.to(self.device) for t in (b, h, q_idx, slot))).cpu()
            kept += int((keep & (q_in_row < real[row][:, None, None])).sum())
        return kept / computed if computed else 1.0


def _compile_enabled() -> bool:
    return os.environ.get("PAGEDBENCH_FLEX_COMPILE", "1") != "0"


def _kernel_choice() -> str:
    """PAGEDBENCH_FLEX_KERNEL: `triton` (default) or `flash`, FlexAttention's FA4-based kernels."""
    choice = os.environ.get("PAGEDBENCH_FLEX_KERNEL", "triton").strip().lower() or "triton"
    if choice not in ("triton", "flash"):
        raise ValueError(f"PAGEDBENCH_FLEX_KERNEL={choice!r} is not one of triton, flash")
    return choice


def _flash_kernel_reason(device: torch.device) -> str | None:
    """Why flex's BACKEND='FLASH' (FA4, CuTe DSL) cannot run here, or None."""
    import importlib.util
    import typing

    from torch.nn.attention import flex_attention as flex_module

    if device.type != "cuda":
        return f"FA4 kernels need CUDA (device is {device})"
    if "FLASH" not in typing.get_args(getattr(flex_module, "_Backend", None)):
        return f"torch {torch.__version__}'s flex has no BACKEND='FLASH'"
    if not _compile_enabled():
        return "BACKEND='FLASH' needs compiled flex (PAGEDBENCH_FLEX_COMPILE=0 is set)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:
        found = False
    return None if found else "flash_attn.cute (FA4) is not installed (pip install 'pagedbench[fa4]')"
