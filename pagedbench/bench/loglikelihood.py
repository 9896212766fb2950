"""Accuracy per backend the way lm-eval-harness scores multiple choice: each choice's
log-likelihood given its context (the sum of its tokens' log-probabilities, teacher-forced), the
answer the one with the highest. Every backend x page dtype is held to `reference` with
unquantized pages: mean and max |delta logprob| over the choice tokens, and agreement of the
chosen answer. The default items come from the shipped held-out text (the true continuation of a
context against continuations taken from elsewhere), so a trained model's accuracy means something.
"""

from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.backends.registry import get_backend
from pagedbench.bench.kv_quality import held_out_segments, teacher_forced_logprobs

BASELINE = ("reference", "auto")


@dataclass(slots=True)
class ChoiceItem:
    """A multiple-choice question as token ids: a context and its candidate continuations."""

    context: list[int]
    choices: list[list[int]]
    answer: int  # index of the right continuation (for accuracy)


def held_out_items(
    model: str, num_items: int = 12, num_choices: int = 4, context_len: int = 64, choice_len: int = 12, resolved=None
) -> list[ChoiceItem]:
    """Items from the shipped held-out text: a context, its true next `choice_len` tokens (the
    answer, at a random place among the choices) and continuations of other contexts."""
    span = context_len + choice_len
    segments = held_out_segments(model, num_items, span, seed=1, resolved=resolved)
    rng = np.random.default_rng(0)
    items = []
    for i, seg in enumerate(segments):
        others = [segments[(i + k) % len(segments)][context_len:] for k in range(1, num_choices)]
        answer = int(rng.integers(num_choices))
        choices = others[:answer] + [seg[context_len:]] + others[answer:]
        items.append(ChoiceItem(seg[:context_len], choices, answer))
    return items


def choice_logprobs(
    model: str, backend: str, kv_cache_dtype: str, items: list[ChoiceItem], device=None, dtype=None, resolved=None
) -> list[list[torch.Tensor]]:
    """[item][choice] -> the log-probability [choice_len] of each of the choice's tokens given the
    context and the choice's tokens before it, through `backend` with `kv_cache_dtype` pages."""
    sequences = [item.context + choice for item in items for choice in item.choices]
    logprobs = teacher_forced_logprobs(model, backend, kv_cache_dtype, sequences, device, dtype, resolved=resolved)
    out, offset = [], 0
    for item in items:
        per_choice = []
        for choice in item.choices:
            n = len(item.context) + len(choice) - 1  # positions of this sequence (all but its last token)
            rows = logprobs[offset + len(item.context) - 1 : offset + n]  # those predicting the choice's tokens
            per_choice.append(rows.gather(-1, torch.tensor(choice)[:, None]).squeeze(-1))
            offset += n
        out.append(per_choice)
    return out


def compare_choices(got: list[list[torch.Tensor]], base: list[list[torch.Tensor]], items: list[ChoiceItem]) -> dict:
    """|delta logprob| over every choice token, and how often the chosen answer agrees (and is right)."""
    delta = torch.cat([(g - b).abs() for gi, bi in zip(got, base) for g, b in zip(gi, bi)])
    picks = [int(np.argmax([float(c.sum()) for c in per_item])) for per_item in got]
    base_picks = [int(np.argmax([float(c.sum()) for c in per_item])) for per_item in base]
    return {
        "items": len(items),
        "choice_tokens": len(delta),
        "mean_abs_dlogprob": float(delta.mean()),
        "max_abs_dlogprob": float(delta.max()),
        "argmax_agreement": float(np.mean([p == q for p, q in zip(picks, base_picks)])),
        "accuracy": float(np.mean([p == item.answer for p, item in zip(picks, items)])),
        "accuracy_reference": float(np.mean([q == item.answer for q, item in zip(base_picks, items)])),
    }


def loglikelihood_check(
    backends: list[str],
    kv_cache_dtypes: list[str],
    model: str = "py-byte-target",
    device=None,
    dtype=None,
    items: list[ChoiceItem] | None = None,
) -> list[dict]:
    """One row per backend x page dtype against `reference` with unquantized pages; a backend
    that cannot run here, or cannot read such pages, gets an "unavailable" row with its reason."""
    from pagedbench.model.loader import resolve_model_config

    resolved = resolve_model_config(model)
    items = items or held_out_items(model, resolved=resolved)
    base = choice_logprobs(model, *BASELINE, items, device, dtype, resolved=resolved)
    rows = []
    for backend in backends:
        for kv in kv_cache_dtypes:
            head = {"model": model, "backend": backend, "kv_cache_dtype": kv}
            why = None if kv == "auto" else get_backend(backend).kv_cache_reason(kv_cache_dtype=kv)
            if why:
                rows.append(head | {"status": "unavailable", "reason": why})
                continue
            try:
                got = base if (backend, kv) == BASELINE else choice_logprobs(
                    model, backend, kv, items, device, dtype, resolved=resolved
                )  # fmt: skip
            except ValueError as e:  # the backend cannot run this model here: it says why
                rows.append(head | {"status": "unavailable", "reason": str(e)})
                continue
            rows.append(head | {"status": "ok", **compare_choices(got, base, items)})
    return rows
