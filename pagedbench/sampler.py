"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p.

Random rows draw exponential noise and take argmax(probs / noise) (equivalent to sampling
from probs); a request with a seed draws its noise from its own generator, so its tokens do
not depend on what else is in the batch.
"""

from dataclasses import dataclass

import torch

from pagedbench.sequence import Sequence


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [B] fp32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] fp32
    min_p: torch.Tensor | None  # [B] fp32
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    generators: list[torch.Generator | None]

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> "SamplingBatch":
        ps = [s.params for s in seqs]

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=col([p.temperature if p.temperature > 0 else 1.0 for p in ps], torch.float32),
            top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in ps], torch.int64)
            if any(p.top_k > 0 for p in ps)
            else None,
            top_p=col([p.top_p for p in ps], torch.float32) if any(p.top_p < 1 for p in ps) else None,
            min_p=col([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
            greedy=col([p.temperature == 0 for p in ps], torch.bool),
            all_greedy=all(p.temperature == 0 for p in ps),
            generators=[s.generator for s in seqs],
        )


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] fp32 -> token ids [B] int64 (on the device)."""
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_tokens, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p (nucleus) set."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the top token always stays
        remove |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under the model's distribution (raw logits, before temperature and
    top-k/top-p, as vLLM reports logprobs): logits [B, V], tokens [B] -> [B] fp32."""
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
