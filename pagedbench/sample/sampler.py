"""Batched sampling on the device: raw logprobs; the grammar mask of structured outputs; allowed
tokens, logit bias, logits processors,
then the bans of bad words and min_tokens (so no processor undoes them); repetition/frequency/
presence penalties; greedy argmax or temperature, top-k, top-p, min-p and a draw.

A random row draws one uniform number and takes the token where it falls in the row's
cumulative distribution (inverse-CDF sampling: one number per row, not one per vocabulary
entry; top-p on CPU draws by rejection instead of sorting). A request with a seed draws from
its own generator, so its tokens do not depend on what else is in the batch. Each feature
costs nothing unless a row uses it, and only the rows that use it are touched. The
parameters' device tensors are built when the batch's sequences change, not every step, and
the host never waits for the device before the tokens are read.
"""

import dataclasses
import operator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedbench.device.transfer import HostCopy, to_device
from pagedbench.sample.sampling_params import SamplingParams, processor_arity


class SamplingSequence(Protocol):
    """What the sampler reads of a sequence (the engine's Sequence)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


class LogitsMask(Protocol):
    """A step's token mask (structured outputs' GrammarMask): sets forbidden logits to -inf in place."""

    def apply(self, logits: torch.Tensor) -> None: ...


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [P] rows of the batch with a penalty
    presence: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]
    output_counts: torch.Tensor  # [P, V] how often each token is in the row's output
    seen: torch.Tensor  # [P, V] bool: in the prompt or the output (repetition penalty)


@dataclass(slots=True)
class SamplingBatch:
    seqs: list[SamplingSequence]  # row i samples for seqs[i]
    # From the requests' parameters (kept while the rows' sequences stay the same):
    temperature: torch.Tensor  # [B] fp32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    max_top_k: int  # the largest enabled top_k (0: none)
    top_p: torch.Tensor | None  # [B] fp32
    min_p: torch.Tensor | None  # [B] fp32
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    generators: list[torch.Generator | None]
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [A], mask [A, V]) allowed_token_ids
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, tokens, fp32 values) logit_bias
    logprob_rows: list[int] | None = None  # rows whose sampled token's logprob is needed
    logprob_index: torch.Tensor | None = None  # the same rows on the device
    num_logprobs: int = 0  # top logprobs returned per row in logprob_rows (the widest request's)
    # From the sequences' outputs so far (rebuilt every step, only when some row uses them):
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens) set to -inf: min_tokens, bad words
    processors: list[tuple] | None = None  # (processor, row indices, their output and prompt token ids)
    penalties: Penalties | None = None
    grammar: LogitsMask | None = None  # structured outputs' mask (set by StructuredOutputManager.mask)

    @classmethod
    def from_seqs(
        cls,
        seqs: list[SamplingSequence],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: list[int] = (),
        previous: "SamplingBatch | None" = None,
        engine_processors: list = (),
    ) -> "SamplingBatch":
        """The batch for `seqs`; the parameter tensors of `previous` are reused (no copy) when
        it was built for the same sequences in the same order. `engine_processors` (LLM(logits_processors=...),
        BatchLogitsProcessors) see every row, after each request's own processors."""
        same = previous is not None and len(previous.seqs) == len(seqs)
        if same and all(map(operator.is_, previous.seqs, seqs)):
            batch = dataclasses.replace(previous, banned=None, processors=None, penalties=None, grammar=None)
        else:
            batch = cls._from_params(seqs, vocab_size, device)
        banned, by_processor, penalized = [], {}, []
        for i, s in enumerate(seqs):  # one pass, a few attribute reads for a plain row (every step, every row)
            p = s.params
            if p.min_tokens or p._bad_words_token_ids:
                banned += [(i, t) for t in _banned_tokens(s, eos_token_ids)]
            for fn in p.logits_processors or ():
                entry = by_processor.setdefault(id(fn), (fn, [], [], []))
                entry[1].append(i)
                entry[2].append(s.output_token_ids)
                entry[3].append(s.prompt_token_ids)
            if p.penalized:
                penalized.append(i)
        if banned:
            batch.banned = tuple(to_device(np.array(c, dtype=np.int64), device) for c in zip(*banned))
        if engine_processors and seqs:
            rows, outputs = list(range(len(seqs))), [s.output_token_ids for s in seqs]
            prompts = [s.prompt_token_ids for s in seqs]
            for fn in engine_processors:
                by_processor[("engine", id(fn))] = (fn, rows, outputs, prompts)
        batch.processors = list(by_processor.values()) or None
        if penalized:
            batch.penalties = _penalties([seqs[i] for i in penalized], penalized, vocab_size, device)
        return batch

    @classmethod
    def _from_params(cls, seqs: list[SamplingSequence], vocab_size: int, device: torch.device) -> "SamplingBatch":
        ps = [s.params for s in seqs]

        def col(values, dtype):
            return to_device(np.array(values, dtype=dtype), device)

        top_ks = [p.top_k for p in ps if p.top_k > 0]
        batch = cls(
            seqs=list(seqs),
            temperature=col([1.0 if p.greedy else p.temperature for p in ps], np.float32),
            top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in ps], np.int64) if top_ks else None,
            max_top_k=min(max(top_ks, default=0), vocab_size),
            top_p=col([p.top_p for p in ps], np.float32) if any(p.top_p < 1 for p in ps) else None,
            min_p=col([p.min_p for p in ps], np.float32) if any(p.min_p > 0 for p in ps) else None,
            greedy=col([p.greedy for p in ps], np.bool_),
            all_greedy=all(p.greedy for p in ps),
            any_greedy=any(p.greedy for p in ps),
            generators=[s.generator for s in seqs],
        )
        allowed = [i for i, p in enumerate(ps) if p.allowed_token_ids is not None]
        if allowed:
            mask = np.zeros((len(allowed), vocab_size), dtype=np.bool_)
            for j, i in enumerate(allowed):
                mask[j, ps[i].allowed_token_ids] = True
            batch.allowed = (col(allowed, np.int64), to_device(mask, device))
        biased = [(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items()]
        if biased:
            rows, tokens, values = zip(*biased)
            batch.bias = (col(rows, np.int64), col(tokens, np.int64), col(values, np.float32))
        wanted = [i for i, p in enumerate(ps) if p.logprobs is not None or p.best_of > 1]
        if wanted:
            batch.logprob_rows = wanted
            batch.logprob_index = col(wanted, np.int64)
            batch.num_logprobs = max(ps[i].logprobs or 0 for i in wanted)
        return batch


def _banned_tokens(seq: SamplingSequence, eos_token_ids) -> list[int]:
    """Tokens `seq` may not produce next: EOS and stop ids before min_tokens, and the last token
    of each bad word whose other tokens end the output."""
    p = seq.params
    banned = []
    grammar = getattr(seq, "grammar", None)
    if seq.num_output_tokens < p.min_tokens and not (grammar is not None and grammar.is_completed()):
        banned += [*([] if p.ignore_eos else eos_token_ids), *p.stop_token_ids]
    for word in p._bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or seq.output_token_ids[-len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def _penalties(seqs: list[SamplingSequence], rows: list[int], vocab_size: int, device: torch.device) -> Penalties:
    def padded(lists):  # ragged token lists -> [P, L] with a spill column V for padding
        width = max(map(len, lists), default=0)
        out = np.full((len(lists), max(width, 1)), vocab_size, dtype=np.int64)
        for j, ids in enumerate(lists):
            out[j, : len(ids)] = ids
        return to_device(out, device)

    def counts(tokens):
        c = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int32, device=device)
        return c.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))[:, :vocab_size]

    names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    weights = to_device(np.array([[getattr(s.params, n) for n in names] for s in seqs], dtype=np.float32), device)
    output_counts = counts(padded([s.output_token_ids for s in seqs]))
    prompt_counts = counts(padded([s.prompt_token_ids for s in seqs]))
    return Penalties(
        rows=to_device(np.array(rows, dtype=np.int64), device),
        presence=weights[:, 0:1],
        frequency=weights[:, 1:2],
        repetition=weights[:, 2:3],
        output_counts=output_counts,
        seen=(output_counts > 0) | (prompt_counts > 0),
    )


@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    token_logprobs: torch.Tensor | None = None  # [L] raw logprob of the sampled token, rows logprob_rows
    token_ranks: torch.Tensor | None = None  # [L] its rank in the vocabulary (1 = most likely)
    top_logprobs: torch.Tensor | None = None  # [L, k]
    top_token_ids: torch.Tensor | None = None  # [L, k]

    def to_host(self) -> "SamplerOutput":
        """The same fields as Python lists, read back in one device-to-host copy (waits for it)."""
        return self.from_host(self.host_copy())

    def host_copy(self) -> HostCopy:
        """Every field in one device-to-host copy, started (the ids and ranks travel as float64, exact
        below 2^53); `from_host` reads it."""
        fields = list(self._fields().values())
        if not any(t.is_floating_point() for t in fields):  # ids only (greedy, no logprobs): int64 as they are
            return HostCopy(torch.cat([t.reshape(-1).long() for t in fields]))
        return HostCopy(torch.cat([t.reshape(-1).double() for t in fields]))

    def from_host(self, copy: HostCopy) -> "SamplerOutput":
        """The fields of `host_copy()`'s copy as Python lists (waits for it)."""
        copied = copy.wait()
        flat, host, start, as_floats = copied.tolist(), {}, 0, copied.is_floating_point()
        for name, t in self._fields().items():
            values = flat[start : start + t.numel()]
            start += t.numel()
            if as_floats and not t.is_floating_point():
                values = [int(v) for v in values]
            if t.dim() == 2:  # [L, k] -> L lists of k
                values = [values[i : i + t.shape[1]] for i in range(0, len(values), t.shape[1])]
            host[name] = values
        return SamplerOutput(**host)

    def _fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


class Sampler:
    def __init__(self, device: torch.device, seed: int, logits_processors: list = ()):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.logits_processors = list(logits_processors)  # engine-wide BatchLogitsProcessors (every row)
        # top-p by sorting (one kernel on a GPU) or, on CPU where a sort of [B, V] costs tens of
        # milliseconds, by rejection draws (a few passes over the row, no sort).
        self.sort_top_p = device.type != "cpu"

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] fp32 -> the sampled tokens and the logprobs asked for (on the device)."""
        raw = logits
        logits = process_logits(logits, batch)
        tokens = self.sample(logits, batch)
        out = SamplerOutput(tokens)
        if batch.logprob_rows is not None:
            rows = batch.logprob_index
            fill_logprobs(out, raw[rows], tokens[rows], batch.num_logprobs)
        return out

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        greedy_tokens = logits.argmax(dim=-1) if batch.any_greedy else None
        probs = warp(logits, batch, self.sort_top_p).softmax(dim=-1)
        if batch.top_p is not None and not self.sort_top_p:
            sampled = self._draw_from_nucleus(probs, batch)
        else:
            sampled = inverse_cdf(probs, self.uniform(range(len(probs)), batch, probs.device))
        return sampled if greedy_tokens is None else torch.where(batch.greedy, greedy_tokens, sampled)

    def uniform(self, rows, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One uniform number per row [len(rows), 1]: a seeded request's from its own generator."""
        u = torch.rand(len(rows), 1, generator=self.generator, device=device)
        for j, i in enumerate(rows):
            if batch.generators[i] is not None:
                u[j] = torch.rand(1, generator=batch.generators[i], device=device)
        return u

    def _draw_from_nucleus(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exact top-p draws without a sort. A row draws from its distribution restricted to the
        tokens more likely than its floor (initially none excluded); the draw is kept when the
        tokens strictly more likely than it hold less than top_p (it is in the nucleus), else
        the floor rises to its probability and the row draws again. Every draw comes from a
        superset of the nucleus, so a kept one follows the renormalised nucleus; each rejection
        removes at least one token, and in practice a row needs one or two draws."""
        num_rows = len(probs)
        tokens = torch.zeros(num_rows, dtype=torch.int64, device=probs.device)
        pending = torch.arange(num_rows, device=probs.device)
        p, floor = probs, None  # the pending rows; their floors (None: nothing excluded yet)
        while len(pending):
            u = self.uniform(pending.tolist(), batch, probs.device)  # CPU only: a host list costs no sync
            t = inverse_cdf(p if floor is None else p.masked_fill(p <= floor, 0), u)
            q = p.gather(-1, t[:, None])
            above = torch.where(p > q, p, 0).sum(dim=-1, keepdim=True)
            keep = (above < batch.top_p[pending, None]).squeeze(-1)
            tokens[pending[keep]] = t[keep]
            again = ~keep
            floor = q[again] if floor is None else torch.maximum(floor[again], q[again])
            pending, p = pending[again], p[again]
        return tokens


def warp(logits: torch.Tensor, batch: SamplingBatch, top_p: bool = True) -> torch.Tensor:
    """Processed logits -> the logits a random row draws from: temperature, min-p, top-k and
    (when `top_p`, by sorting) top-p."""
    logits = logits / batch.temperature[:, None]
    if batch.min_p is not None:  # before top-k/top-p, as in vLLM v1
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is not None:
        logits = _apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.top_p is not None and top_p:
        logits = _apply_top_p(logits, batch.top_p)
    return logits


def fill_logprobs(out: SamplerOutput, raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: int) -> None:
    """`out`'s logprob fields for raw logits rows [L, V] whose tokens were `tokens` [L]: each
    token's logprob and rank, and the top `num_logprobs`."""
    logprobs = raw.log_softmax(dim=-1)
    picked = logprobs.gather(-1, tokens[:, None])
    out.token_logprobs = picked.squeeze(-1)
    out.token_ranks = (logprobs > picked).sum(dim=-1) + 1
    if num_logprobs:
        out.top_logprobs, out.top_token_ids = logprobs.topk(num_logprobs, dim=-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u [B, 1] x the row's total: never
    a zero-probability one (its cumulative value equals the token's before it, with CPU's
    sequential sum; on a GPU the scan is checked). The target is kept below the total, which
    u x total can round up to."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    if probs.device.type != "cpu":  # a parallel scan may round a zero-probability step upwards
        allowed = probs.gather(-1, tokens[:, None]).squeeze(-1) > 0
        tokens = torch.where(allowed, tokens, probs.argmax(dim=-1))
    return tokens


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The grammar mask, allowed tokens, logit biases, logits processors, bans (min_tokens, bad words)
    and penalties (a new tensor only where a row uses one)."""
    features = (batch.grammar, batch.allowed, batch.banned, batch.bias, batch.processors, batch.penalties)
    if all(x is None for x in features):
        return logits
    logits = logits.clone()
    if batch.grammar is not None:  # first, as vLLM applies the grammar bitmask before sampling
        batch.grammar.apply(logits)
    if batch.allowed is not None:
        rows, mask = batch.allowed
        logits[rows] = logits[rows].masked_fill(~mask, float("-inf"))
    if batch.bias is not None:
        rows, tokens, values = batch.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    for fn, rows, output_token_ids, prompt_token_ids in batch.processors or ():
        arity = processor_arity(fn)
        if arity == 0:  # a BatchLogitsProcessor: every row that carries it at once
            logits[rows] = fn(output_token_ids, logits[rows])
            continue
        for row, output, prompt in zip(rows, output_token_ids, prompt_token_ids):  # vLLM's per-request forms
            logits[row] = fn(output, logits[row]) if arity == 2 else fn(prompt, output, logits[row])
    if batch.banned is not None:  # after the user's processors, which cannot undo min_tokens or bad words
        logits[batch.banned] = float("-inf")
    if batch.penalties is not None:
        logits[batch.penalties.rows] = apply_penalties(logits[batch.penalties.rows], batch.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties on logits [P, V]: repetition (prompt and output tokens: positive logits
    divided by it, negative ones multiplied), then frequency (times the output count) and presence
    (once per token in the output) subtracted."""
    repeated = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    logits = torch.where(p.seen, repeated, logits)
    return logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k alone, without a full sort: each row keeps the logits at least its k-th largest
    (ties at the k-th kept, as in vLLM); rows with top-k disabled (k = V) keep everything."""
    top = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top.gather(-1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth = kth.masked_fill((top_k >= logits.shape[-1])[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's nucleus: the most likely tokens whose
    probability before them is below top_p (the top token always stays). Sorts the row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    remove = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
