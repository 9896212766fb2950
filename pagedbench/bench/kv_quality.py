"""Quality of a quantized KV cache: the model teacher-forced over held-out text (so errors do not
compound), each backend with pages stored as `kv_cache_dtype` against the same backend with
unquantized pages: per-position KL divergence and top-1 agreement of the next-token
distributions, and perplexity of the text itself. The text goes in chunks (a chunked prefill), so
every chunk after the first attends to pages earlier steps quantized; within a step the backends
read the step's own K/V back from the cache too."""

import math

import numpy as np
import torch

from pagedbench.backends.registry import get_backend
from pagedbench.config import EngineConfig
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.step_batch import build_step_inputs

MILESTONE = "top-1 agreement >= 99 % and perplexity within 1 %"


def held_out_segments(
    model: str = "py-byte-target", num_segments: int = 4, length: int = 512, seed: int = 0, resolved=None
):
    """Held-out Python source (the trained pair never saw it) from random places, as `model` reads
    it: bytes as ids for the byte-level pair and presets, a real model's own tokens. `resolved`:
    `model` as the command resolved it (else resolved here)."""
    from pagedbench.model.loader import resolve_model_config
    from pagedbench.model.tokenizer import tokenizer_for
    from pagedbench.model.trained_pair import VOCAB, corpus, held_out_tokens

    text = corpus()[1]
    starts = np.random.default_rng(seed).integers(0, len(text) - length, num_segments)
    config, path = resolved or resolve_model_config(model)
    if path is not None and config.vocab_size > VOCAB:
        tokenizer = tokenizer_for(None, path, config.vocab_size, config.eos_token_ids)
        return held_out_tokens(tokenizer, starts, [length] * num_segments)
    return [list(text[s : s + length]) for s in starts]


@torch.no_grad()
def teacher_forced_logprobs(
    model: str,
    backend: str,
    kv_cache_dtype: str,
    segments: list[list[int]],
    device=None,
    dtype=None,
    chunk: int = 128,
    resolved=None,
    index_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Log-probabilities [positions, vocab] (fp32, on the host) of the next token at every position
    but each segment's last, the segments run side by side in chunks of `chunk` tokens. `resolved`:
    `model` as the command resolved it (a ResolvedModel; else the engine resolves it)."""
    block_size = 16
    num_blocks = sum(-(-len(s) // block_size) for s in segments) + 4
    config = EngineConfig(
        model=model, backend=backend, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False, seed=0,
        index_cache_dtype=index_cache_dtype,
    )  # fmt: skip
    engine = LLMEngine(config, model=resolved)
    runner, bm = engine.runner, engine.block_manager
    seqs = [Sequence(str(i), None, ids, SamplingParams()) for i, ids in enumerate(segments)]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in seqs):
        active = [s for s in seqs if s.num_computed_tokens < s.num_tokens - 1]
        num_new = [min(chunk, s.num_tokens - 1 - s.num_computed_tokens) for s in active]
        for s, n in zip(active, num_new):
            bm.allocate(s, s.num_computed_tokens + n)
        inputs = build_step_inputs(active, num_new, block_size, runner.num_cache_blocks, engine.device)
        inputs.logits_indices = torch.arange(sum(num_new), device=engine.device)  # every position
        logits = runner.run(inputs, runner.backend.plan(inputs.metadata)).float().log_softmax(dim=-1).cpu()
        for s, part in zip(active, logits.split(num_new)):
            rows[int(s.request_id)].append(part)
            s.num_computed_tokens += len(part)
    engine.shutdown()
    return torch.cat([torch.cat(r) for r in rows])


def targets(segments: list[list[int]]) -> torch.Tensor:
    """The token each teacher-forced position predicts."""
    return torch.tensor([t for s in segments for t in s[1:]])


def compare(quantized: torch.Tensor, exact: torch.Tensor, next_tokens: torch.Tensor) -> dict:
    """KL(exact || quantized) per position, top-1 agreement, and both perplexities."""
    kl = (exact.exp() * (exact - quantized)).sum(dim=-1)
    ppl = [math.exp(-float(lp.gather(-1, next_tokens[:, None]).mean())) for lp in (quantized, exact)]
    agreement = float((quantized.argmax(-1) == exact.argmax(-1)).float().mean())
    return {
        "positions": len(exact),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": agreement,
        "perplexity": ppl[0],
        "perplexity_unquantized": ppl[1],
        "perplexity_change": ppl[0] / ppl[1] - 1,
        "meets_milestone": bool(agreement >= 0.99 and abs(ppl[0] / ppl[1] - 1) <= 0.01),
    }


def kv_quality(
    backends: list[str], kv_cache_dtypes: list[str], model: str = "py-byte-target", device=None, dtype=None
) -> list[dict]:
    """One row per backend x quantized kv_cache_dtype; a backend that cannot run here, or cannot
    read such pages, gets "unavailable" rows with its reason (and is not run for nothing)."""
    from pagedbench.model.loader import resolve_model_config

    resolved = resolve_model_config(model)  # once for every backend and page dtype
    segments = held_out_segments(model, resolved=resolved)
    next_tokens = targets(segments)
    rows = []
    for backend in backends:
        heads = {kv: {"model": model, "backend": backend, "kv_cache_dtype": kv} for kv in kv_cache_dtypes}
        reasons = {kv: get_backend(backend).kv_cache_reason(kv_cache_dtype=kv) for kv in kv_cache_dtypes}
        rows += [{**heads[kv], "status": "unavailable", "reason": why} for kv, why in reasons.items() if why]
        readable = [kv for kv, why in reasons.items() if why is None]
        if not readable:
            continue
        try:
            exact = teacher_forced_logprobs(model, backend, "auto", segments, device, dtype, resolved=resolved)
        except ValueError as e:  # the backend cannot run this model here: it says why
            rows += [{**heads[kv], "status": "unavailable", "reason": str(e)} for kv in readable]
            continue
        for kv in readable:
            try:
                quantized = teacher_forced_logprobs(model, backend, kv, segments, device, dtype, resolved=resolved)
            except ValueError as e:
                rows.append({**heads[kv], "status": "unavailable", "reason": str(e)})
                continue
            rows.append({**heads[kv], "status": "ok", **compare(quantized, exact, next_tokens)})
    return rows


def index_key_quality(model: str, backend: str = "sdpa", device=None, dtype=None, segments=None) -> dict:
    """DeepSeek-V3.2's fp8 index keys (a scale per token) against keys in the model's dtype, the model
    teacher-forced over held-out text: the share of each query's top-k the fp8 keys still pick (mean
    and worst over every layer's queries whose past exceeds the top-k), and the next-token
    distributions' KL and top-1 agreement."""
    from pagedbench.model.loader import resolve_model_config
    from pagedbench.model.sparse_index import observe_selections

    resolved = resolve_model_config(model)
    if resolved[0].indexer is None:
        raise ValueError(f"{model} has no sparse-attention indexer (DeepSeek-V3.2's): no index keys to store as fp8")
    segments = segments or held_out_segments(model, resolved=resolved)
    runs = {}
    for index_dtype in ("auto", "fp8"):
        with observe_selections() as picks:
            logprobs = teacher_forced_logprobs(model, backend, "auto", segments, device, dtype, resolved=resolved,
                                               index_cache_dtype=index_dtype)  # fmt: skip
        runs[index_dtype] = (logprobs, torch.cat(picks))
    (exact, exact_picks), (fp8, fp8_picks) = runs["auto"], runs["fp8"]
    # only queries whose past exceeds the top-k choose (the others keep every token, whatever the keys)
    contested = (exact_picks >= 0).all(dim=1)
    kept = torch.tensor([_overlap(a, b) for a, b in zip(exact_picks[contested], fp8_picks[contested])])
    return {"model": model, "backend": backend, "index_cache_dtype": "fp8", "topk": resolved[0].indexer.topk,
            "queries": len(exact_picks),
            "contested_queries": len(kept), "topk_overlap": float(kept.mean()) if len(kept) else float("nan"),
            "min_topk_overlap": float(kept.min()) if len(kept) else float("nan"),
            **compare(fp8, exact, targets(segments))}  # fmt: skip


def _overlap(exact: torch.Tensor, other: torch.Tensor) -> float:
    """The share of one query's picks (slots, -1: none) that the other selection also made."""
    want = exact[exact >= 0]
    return float(torch.isin(want, other[other >= 0]).float().mean()) if len(want) else 1.0
