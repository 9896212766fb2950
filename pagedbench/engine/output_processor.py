"""OutputProcessor: what a step's new tokens mean for their requests. It detokenizes them
incrementally and records logprobs and prompt logprobs (for Scheduler.update_from_output, which
appends the tokens and checks stops), and builds each request's RequestOutput."""

from collections.abc import Callable

import numpy as np

from pagedbench.device.transfer import to_device, to_list
from pagedbench.engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from pagedbench.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampler import SamplerOutput


class OutputProcessor:
    def __init__(self, tokenizer):
        if tokenizer is not None:
            backend_tokenizer(tokenizer)  # a tokenizer DecodeStream cannot use fails here, not mid-step
        self.tokenizer = tokenizer

    def new_text(self, seq: Sequence, token: int) -> str:
        """The text `seq`'s new output `token` adds to its output_text ("" where it is not decoded)."""
        detokenizer = self._detokenizer(seq)
        new_text = detokenizer.step(token) if detokenizer is not None else ""
        seq.output_text += new_text
        return new_text

    def flush_text(self, seq: Sequence) -> None:
        """`seq` has stopped: the text held back for a partial character, unless a stop string ended it."""
        if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += seq.detokenizer.flush()

    def record_logprobs(self, seqs: list[Sequence], rows: list[int], out: SamplerOutput) -> None:
        """For the batch rows `rows` (of `seqs`): cumulative logprobs, and where the request asks
        for logprobs, the sampled token's and the top ones (vLLM's layout: token id -> Logprob)."""
        tokens, picked, ranks = out.tokens, out.token_logprobs, out.token_ranks  # host lists (to_host)
        top = (out.top_token_ids, out.top_logprobs) if out.top_token_ids is not None else None
        for k, row in enumerate(rows):
            seq = seqs[row]
            seq.cumulative_logprob += picked[k]
            if seq.params.logprobs is None:
                continue
            entry = {}
            if top is not None:
                for rank, (tid, lp) in enumerate(zip(top[0][k][: seq.params.logprobs], top[1][k]), 1):
                    entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
            entry[tokens[row]] = Logprob(picked[k], ranks[k], self._token_text(tokens[row], seq))
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)

    def record_prompt_logprobs(self, seqs: list[Sequence], rows: list[tuple[int, int, int]], logits) -> None:
        """Prompt logprobs of this step's prompt chunks: logits row j of (seq, first, count)
        predicts prompt token first + j + 1."""
        offset = 0
        for i, first, count in rows:
            seq = seqs[i]
            chunk = logits[offset : offset + count].log_softmax(dim=-1)
            offset += count
            targets = seq.prompt_token_ids[first + 1 : first + 1 + count]
            picked = chunk.gather(-1, to_device(np.array(targets, dtype=np.int64), chunk.device)[:, None])
            ranks = to_list((chunk > picked).sum(dim=-1) + 1)
            top_lps, top_ids = (
                map(to_list, chunk.topk(seq.params.prompt_logprobs, dim=-1))
                if seq.params.prompt_logprobs
                else (None, None)
            )
            picked = to_list(picked.squeeze(-1))
            seq.prompt_logprobs = seq.prompt_logprobs or []
            for j, token in enumerate(targets):
                entry = {}
                if top_ids is not None:
                    for rank, (tid, lp) in enumerate(zip(top_ids[j], top_lps[j]), 1):
                        entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
                entry[token] = Logprob(picked[j], ranks[j], self._token_text(token, seq))
                seq.prompt_logprobs.append(entry)

    def output(self, group: SequenceGroup) -> RequestOutput:
        return request_output(group, self._decode)

    def process_outputs(self, progressed: list, now: float) -> list[RequestOutput]:
        """The outputs of the requests a step progressed (RequestProgress, from update_from_output),
        whose new tokens arrived `now` (tokens verified together arrive together)."""
        for p in progressed:
            p.group.token_times += [now] * p.num_new_tokens
        return [self.output(p.group) for p in progressed]

    def _decodes(self, seq: Sequence) -> bool:
        """Whether `seq`'s tokens become text: there is a tokenizer and the request did not ask for token ids only."""
        return self.tokenizer is not None and getattr(seq.params, "detokenize", True)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer | None:
        """`seq`'s incremental detokenizer (made at its first output token), or None where it is not decoded."""
        if seq.detokenizer is None and self._decodes(seq):
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
        return seq.detokenizer

    def _token_text(self, token: int, seq: Sequence) -> str | None:
        return self.tokenizer.decode([token]) if self._decodes(seq) else None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def completions(group: SequenceGroup, decode: Callable[[list[int]], str] | None) -> list[CompletionOutput]:
    """The request's returned samples: its n samples by index, or once finished with best_of > n
    the n best by cumulative logprob; a beam search's finished beams, best first."""
    if group.beam is not None:
        return [
            CompletionOutput(
                i,
                decode(h.output_token_ids) if decode else "",
                h.output_token_ids,
                h.finish_reason,
                h.stop_reason,
                h.cum_logprob,
            )
            for i, h in enumerate(group.beam.finished if group.finished else [])
        ]
    p = group.params
    seqs = sorted(group.seqs, key=lambda s: s.index)
    if group.finished and p.best_of > p.n:
        seqs.sort(key=lambda s: -s.cumulative_logprob)
    return [
        CompletionOutput(
            s.index,
            s.output_text,
            s.output_token_ids,
            s.finish_reason,
            s.stop_reason,
            s.cumulative_logprob if p.best_of > 1 or p.logprobs is not None else None,
            None if s.logprobs is None else list(s.logprobs),
        )
        for s in seqs[: p.n]
    ]


def request_output(group: SequenceGroup, decode: Callable[[list[int]], str] | None = None) -> RequestOutput:
    """The request's output so far; metrics once it has finished."""
    metrics = None
    finished = group.finished
    if finished:
        times = group.token_times
        metrics = RequestMetrics(group.arrival_time, times[0], times, times[-1], group.num_preemptions)
    first = group.seqs[0] if group.seqs and group.beam is None else None
    wanted = first is not None and first.params.prompt_logprobs is not None
    prompt_logprobs = (first.prompt_logprobs or []) if wanted else None
    group.note_cached_tokens()
    return RequestOutput(
        group.request_id,
        group.prompt,
        group.prompt_token_ids,
        completions(group, decode),
        finished,
        metrics,
        None if prompt_logprobs is None else [None, *prompt_logprobs],  # nothing predicts the first token
        group.num_cached_tokens,
    )
