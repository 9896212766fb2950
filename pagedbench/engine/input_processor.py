"""InputProcessor: a user's prompt and parameters in, a validated request (SequenceGroup) out;
a bad request is refused before anything is queued."""

import torch

from pagedbench.config import EngineConfig
from pagedbench.engine.beam_search import BeamSearch
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.config import ModelConfig
from pagedbench.sample.sampling_params import BatchLogitsProcessor, BeamSearchParams, SamplingParams, is_int


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer,
        max_model_len: int,
        device: torch.device,
        structured: StructuredOutputManager,
    ):
        self.config, self.model_config = config, model_config
        self.tokenizer, self.max_model_len, self.device = tokenizer, max_model_len, device
        self.structured = structured

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize(prompt, self.tokenizer, self.config.model)

    def validate(self, token_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        """ValueError/TypeError naming what is wrong with the request; nothing else happens."""
        vocab_size, max_num_seqs = self.model_config.vocab_size, self.config.max_num_seqs
        if isinstance(params, BeamSearchParams):
            params.validate()
            validate_request(token_ids, SamplingParams(), self.max_model_len, vocab_size, True)
        else:
            has_tokenizer = self.tokenizer is not None
            validate_request(token_ids, params, self.max_model_len, vocab_size, has_tokenizer, self.config.max_logprobs)
            if params.structured_outputs is not None:
                self.structured.compile(params.structured_outputs)  # compiled once per constraint, checked here
        if params.width > max_num_seqs:
            name = "beam_width" if isinstance(params, BeamSearchParams) else "best_of"
            raise ValueError(f"{name}={params.width} is more than max_num_seqs={max_num_seqs}")

    def validate_priority(self, priority) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} given, but scheduling_policy is {self.config.scheduling_policy!r}")

    def generator(self, params, index: int) -> torch.Generator | None:
        """Sample `index` of a seeded request draws from seed + index (vLLM's per-sample seeds)."""
        if getattr(params, "seed", None) is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed + index)

    def process(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None,
        priority: int,
    ) -> SequenceGroup:
        """The request's state, its first sequence waiting to be scheduled."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        self.validate_priority(priority)
        if isinstance(params, SamplingParams) and params.bad_words:
            params._bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        seq = Sequence(request_id, text, token_ids, params)
        seq.priority = priority
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.generator = self.generator(params, 0)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            seq.grammar = self.structured.matcher(params.structured_outputs)
        group = SequenceGroup(request_id, text, token_ids, params, [seq], seq.arrival_time)
        if isinstance(params, BeamSearchParams):
            group.beam = BeamSearch(params, self.model_config.eos_token_ids, self.max_model_len)
        return group


def is_single_prompt(prompts) -> bool:
    """A str, a prompt dict, or a list of token ids (nano-vllm's form) is one prompt; any other
    iterable is a batch of them."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and all(is_int(t) for t in prompts)
    )


def prompt_list(prompts) -> list:
    """`prompts` as a list of prompts (one prompt, or a batch); TypeError for anything else."""
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            "prompts must be a str, a {'prompt': ...} or {'prompt_token_ids': [...]} dict, a list of token ids, "
            f"or a list of those; got {type(prompts).__name__}"
        )
    return list(prompts)


def tokenize(prompt, tokenizer, model_name: str) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt in any of vLLM's forms: a str, {'prompt': str},
    {'prompt_token_ids': [...]} (optionally with its 'prompt' text), or a list of token ids."""
    if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
        return None, list(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"model {model_name!r} has no tokenizer; pass {{'prompt_token_ids': [...]}} prompts (or tokenizer=)"
            )
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return prompt.get("prompt"), list(ids)
    raise ValueError(
        "a prompt is a str, {'prompt': str}, {'prompt_token_ids': [...]} or a list of token ids, "
        f"got {type(prompt).__name__}"
    )


def validate_request(
    token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    has_tokenizer: bool,
    max_logprobs: int = 20,
) -> None:
    """ValueError/TypeError naming what is wrong; nothing else happens."""
    params.validate()
    if not token_ids:
        raise ValueError("prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if params.bad_words and not has_tokenizer:
        raise ValueError(
            "bad_words need a tokenizer; this model has none (use allowed_token_ids or a logits processor)"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"{name}={value} is more than the {max_logprobs} logprobs a request may ask for (max_logprobs)"
            )
    listed = (params.allowed_token_ids or []) + params.stop_token_ids + list(params.logit_bias or {})
    outside = [t for t in listed if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(
            f"allowed_token_ids/stop_token_ids/logit_bias: token id {outside[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences of each bad word, alone and after a space (vLLM's two spellings)."""
    out = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def engine_logits_processors(processors) -> list[BatchLogitsProcessor]:
    """LLM(logits_processors=...): BatchLogitsProcessor instances, or subclasses to build; TypeError otherwise."""
    if processors is None:
        return []
    if not isinstance(processors, (list, tuple)):
        raise TypeError(f"logits_processors must be a list, got {type(processors).__name__}")
    built = []
    for p in processors:
        if isinstance(p, type) and issubclass(p, BatchLogitsProcessor):
            p = p()
        if not isinstance(p, BatchLogitsProcessor):
            raise TypeError(
                "LLM(logits_processors=...) takes BatchLogitsProcessor instances or subclasses (batch-wise, every "
                f"row); got {p!r} (a per-request function goes in SamplingParams.logits_processors)"
            )
        built.append(p)
    return built
