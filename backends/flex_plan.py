"""Host side of a flex step: the query rows of each flex call and, per BlockMask row, the span
of logical pages it lists (its sequence, first page, first full page, full and masked counts), as
numpy index arrays that `device_arrays` copies to the device in one go. Everything here is O(rows and
tokens), never O(pages): the device expands the spans over the block table (flex_masks.py).

Two call kinds. `decode`: one BlockMask row per sequence with at most MAX_DECODE_QUERY new tokens,
queries `[batch, q_len]` (short rows repeat their last token). `prefill`: the other chunks as one
flat row, each chunk padded to whole query blocks so a block (a BlockMask row) never mixes sequences.
"""

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from pagedbench.device.transfer import to_device

MAX_DECODE_QUERY = 8  # sequences with at most this many new tokens take the per-sequence decode call

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def index_in_group(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: 0..counts[i]-1 for each group i, concatenated."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


class CallArrays(NamedTuple, Generic[Array]):
    """A call's index arrays: numpy on the host, then views of the step's single device copy.
    Query rows are the call's `[batch * q_len]` flattened rows. Mask row r lists the logical pages
    [row_start, row_start + num_masked + num_full) of sequence row_seq: the full run
    [row_full_start, + num_full) as full blocks, the pages before and after it as masked ones."""

    token: Array  # [batch * q_len] flat token each query row reads
    real: Array  # [K] query rows that are real tokens (the rest repeat one)
    dest: Array  # [K] flat token each real row answers
    mask_seq: Array  # sequence the mask_mod looks up: decode [batch] per row, prefill [q_len] per query row
    mask_pos: Array  # [batch * q_len] position of each query row in its sequence
    row_seq: Array  # [rows] sequence of each mask row
    row_start: Array  # [rows] its first listed logical page
    row_full_start: Array  # [rows] its first full page
    num_full: Array  # [rows] full blocks of each mask row
    num_masked: Array  # [rows] masked blocks of each mask row


@dataclass(slots=True)
class CallPlan:
    """One flex call's layout on the host."""

    kind: str  # "decode" | "prefill"
    batch: int  # flex batch: decode rows, or 1
    q_len: int  # query rows per batch entry
    identity: bool  # query rows are flat tokens 0..batch*q_len-1: no gather, no scatter
    rows: int  # BlockMask rows
    full_blocks: bool  # the BlockMask lists full blocks; else every listed block is masked
    real_rows: np.ndarray  # [rows] real query rows in each BlockMask row (tile efficiency)
    host: CallArrays[np.ndarray]


def plan_calls(
    qsl: np.ndarray,
    ctx: np.ndarray,
    *,
    block_size: int,
    kv_block_size: int,
    q_block_size: int,
    decode_full_blocks: bool,
    static_decode_batch: bool,
    sliding_window: int | None = None,
) -> list[CallPlan]:
    """The step's flex calls from query_start_loc [B+1] and context lengths [B]; with a sliding
    window, the pages before every row's window are left out of its BlockMask row."""
    short = np.diff(qsl) <= MAX_DECODE_QUERY
    # Small pages sharing a KV block leave no block whose slots one row sees whole: all are masked.
    one_page_per_block = kv_block_size == block_size
    decode_full_blocks = decode_full_blocks and one_page_per_block
    plans = (
        plan_decode(
            np.flatnonzero(short), qsl, ctx, block_size, decode_full_blocks, static_decode_batch, sliding_window
        ),
        plan_prefill(np.flatnonzero(~short), qsl, ctx, block_size, q_block_size, one_page_per_block, sliding_window),
    )
    return [plan for plan in plans if plan is not None]


def plan_decode(
    seqs: np.ndarray,
    qsl: np.ndarray,
    ctx: np.ndarray,
    block_size: int,
    full_blocks: bool,
    static_batch: bool,
    sliding_window: int | None = None,
) -> CallPlan | None:
    """Rows of the per-sequence decode call, one per sequence in `seqs`."""
    if not len(seqs):
        return None
    q_lens = qsl[seqs + 1] - qsl[seqs]
    q_len = 1 << int(q_lens.max() - 1).bit_length()  # 1, 2, 4 or 8
    batch = max(len(seqs), 2)  # a batch of 1 would compile a graph of its own
    if static_batch:
        batch = 1 << (batch - 1).bit_length()
    row_seq = np.concatenate([seqs, np.full(batch - len(seqs), seqs[0])])  # spare rows repeat the first
    q_lens = np.concatenate([q_lens, np.zeros(batch - len(seqs), dtype=np.int64)])
    offset = np.minimum(np.arange(q_len)[None, :], np.maximum(q_lens, 1)[:, None] - 1)  # [batch, q_len]
    token = qsl[row_seq][:, None] + offset
    pos = ctx[row_seq][:, None] + offset
    spare = q_lens == 0  # spare rows read no page
    first_pos = np.where(spare, -1, ctx[row_seq])
    last_pos = np.where(spare, -1, ctx[row_seq] + q_lens - 1)
    spans = _row_spans(row_seq, first_pos, last_pos, block_size, full_blocks, sliding_window)
    identity = q_len == 1 and len(seqs) == batch and np.array_equal(seqs, np.arange(batch)) and qsl[batch] == batch
    real = (np.arange(q_len)[None, :] < q_lens[:, None]).reshape(-1)
    host = _call_arrays(token.reshape(-1), real, row_seq, pos.reshape(-1), spans)
    return CallPlan("decode", batch, q_len, identity, batch, full_blocks, q_lens, host)


def plan_prefill(
    seqs: np.ndarray,
    qsl: np.ndarray,
    ctx: np.ndarray,
    block_size: int,
    q_block_size: int,
    full_blocks: bool,
    sliding_window: int | None = None,
) -> CallPlan | None:
    """Query blocks of the flat prefill call, each within one sequence's chunk."""
    if not len(seqs):
        return None
    qb = q_block_size
    q_lens = qsl[seqs + 1] - qsl[seqs]
    blocks = -(-q_lens // qb)
    block_seq = np.repeat(seqs, blocks)
    block_q_len = np.repeat(q_lens, blocks)  # length of each block's chunk
    block_q0 = index_in_group(blocks) * qb  # first query offset of each block in its chunk
    block_real = np.minimum(qb, block_q_len - block_q0)
    # Mask rows: the blocks, plus an empty row (never a size-1 dimension).
    first_pos = np.append(ctx[block_seq] + block_q0, -1)
    last_pos = np.append(ctx[block_seq] + block_q0 + block_real - 1, -1)
    row_seq = np.append(block_seq, seqs[0])
    spans = _row_spans(row_seq, first_pos, last_pos, block_size, full_blocks, sliding_window)
    # Query rows: block r's rows are offsets block_q0[r] + 0..qb-1, past the chunk repeating its last token.
    offset = block_q0[:, None] + np.arange(qb)[None, :]
    real = (offset < block_q_len[:, None]).reshape(-1)
    offset = np.minimum(offset, block_q_len[:, None] - 1)
    token = (qsl[block_seq][:, None] + offset).reshape(-1)
    pos = (ctx[block_seq][:, None] + offset).reshape(-1)
    host = _call_arrays(token, real, np.repeat(block_seq, qb), pos, spans)
    return CallPlan("prefill", 1, len(token), False, len(row_seq), full_blocks, np.append(block_real, 0), host)


def _row_spans(
    row_seq: np.ndarray,
    first_pos: np.ndarray,
    last_pos: np.ndarray,
    block_size: int,
    full_blocks: bool,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Each mask row's pages from its first query's window start (page 0 without a window) up to
    its last query position (-1: none), as the row_* and num_* of `CallArrays`. With `full_blocks`,
    pages every query of the row sees whole are full blocks: at or before the first query, and
    (with a window) inside the last query's window."""
    bs = block_size
    end = np.where(last_pos >= 0, last_pos // bs + 1, 0)  # one past the row's last page
    start = np.zeros_like(end)
    full_start = np.zeros_like(end)
    if sliding_window is not None:
        start = np.minimum(np.maximum(first_pos - sliding_window + 1, 0) // bs, end)
        full_start = -(-np.maximum(last_pos - sliding_window + 1, 0) // bs)
    full_end = np.minimum((first_pos + 1) // bs, end) if full_blocks else full_start
    num_full = np.maximum(full_end - full_start, 0)
    return row_seq, start, np.minimum(full_start, end), num_full, end - start - num_full


def _call_arrays(
    token: np.ndarray, real: np.ndarray, mask_seq: np.ndarray, mask_pos: np.ndarray, spans: tuple[np.ndarray, ...]
) -> CallArrays[np.ndarray]:
    """`real`: [batch * q_len] bool, whether each query row is a real token."""
    return CallArrays(token, np.flatnonzero(real), token[real], mask_seq, mask_pos, *spans)


def device_arrays(plans: list[CallPlan], device: torch.device) -> list[CallArrays[torch.Tensor]]:
    """Every call's index arrays in one host-to-device copy, as views of it."""
    host = [a for plan in plans for a in plan.host]
    flat = to_device(np.concatenate(host), device).split([len(a) for a in host])
    n = len(CallArrays._fields)
    return [CallArrays(*flat[i * n : (i + 1) * n]) for i in range(len(plans))]
