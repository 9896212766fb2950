"""The offline entry point, with vLLM's names: LLM(model).generate(prompts, params)."""

from tqdm.auto import tqdm

from pagedbench.config import EngineConfig
from pagedbench.engine.data_parallel import make_engine
from pagedbench.engine.input_processor import prompt_list
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedbench.model.tokenizer import chat_prompt
from pagedbench.sample.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, with_output_kind

# vLLM arguments that change nothing here, accepted so vLLM scripts run: the value each may take.
NO_OP_ARGS = {
    "trust_remote_code": (True, False),  # only the built-in Llama-family code runs, never a model's own
    "disable_log_stats": (True, False),
    "enable_chunked_prefill": (True,),  # prefills are always chunked (vLLM v1)
    "tokenizer_mode": ("auto",),
}


def _choose_threads(threads: int | None, device) -> None:
    """CPU threads for torch, as the CLI chooses them: `threads` if given, else OMP_NUM_THREADS if
    set, else the usable cores less those busy now (a thread on a busy core stalls the others at
    every OpenMP barrier: 19-22 s per chat answer at load 3-5 with 2 threads, 3.2-3.6 s with 1)."""
    import os
    import sys

    import torch

    from pagedbench.device.cpu_threads import default_threads

    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4 * (os.cpu_count() or 1):
            raise ValueError(f"threads must be an int in 1..{4 * (os.cpu_count() or 1)}, got {threads!r}")
        torch.set_num_threads(threads)
        return
    on_cpu = device is None and not torch.cuda.is_available() or str(device).startswith("cpu")
    if not on_cpu or os.environ.get("OMP_NUM_THREADS"):
        return
    chosen, why = default_threads()
    if chosen != torch.get_num_threads():
        torch.set_num_threads(chosen)
        print(f"pagedbench: CPU threads: {chosen} ({why}; OMP_NUM_THREADS or threads= overrides)", file=sys.stderr)


class LLM:
    def __init__(self, model: str, logits_processors: list | None = None, **engine_args):
        """`model`: an HF model directory or a preset. `engine_args`: any EngineConfig field
        (backend, device, dtype, block_size, num_blocks, max_num_seqs, max_num_batched_tokens,
        max_model_len, seed, tensor_parallel_size, enable_prefix_caching, scheduling_policy,
        preemption_mode, swap_space, gpu_memory_utilization, cpu_kv_cache_bytes).

        `threads`: CPU threads for torch (default: OMP_NUM_THREADS, else the usable cores less those
        busy now, as the CLI chooses; a one-line note says when it changes torch's count).

        `logits_processors`: engine-wide BatchLogitsProcessors (instances or subclasses), applied to
        every row each step after each request's own (SamplingParams.logits_processors).

        With tensor_parallel_size, pipeline_parallel_size or data_parallel_size > 1 the engine
        starts worker processes (spawn): a script doing so needs the `if __name__ == "__main__":`
        guard; `shutdown()` (or exit) stops them."""
        if "policy" in engine_args:  # a short name for scheduling_policy
            policy = engine_args.pop("policy")
            if engine_args.setdefault("scheduling_policy", policy) != policy:
                raise ValueError("policy and scheduling_policy disagree; give one")
        for name, allowed in NO_OP_ARGS.items():
            if name in engine_args and engine_args.pop(name) not in allowed:
                raise ValueError(f"{name} may only be {' or '.join(map(repr, allowed))} here")
        _choose_threads(engine_args.pop("threads", None), engine_args.get("device"))
        unknown = sorted(set(engine_args) - set(EngineConfig.names()))
        if unknown:
            raise TypeError(
                f"LLM() got an unknown engine argument {unknown[0]!r}; known: {', '.join(EngineConfig.names())}"
            )
        self._other_outputs: list[RequestOutput] = []  # finished requests generate() did not add
        self.engine = make_engine(EngineConfig(model=model, **engine_args), logits_processors)

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for `engine`."""
        return self.engine

    def get_tokenizer(self):
        """The Hugging Face tokenizer, or None for a preset without one."""
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any."""
        self.engine.shutdown()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. A prompt is a str, {"prompt": str},
        {"prompt_token_ids": [...]} or a list of token ids; `prompts` one of them or a list.
        Every prompt is validated before any is queued, so a bad one raises ValueError without
        starting the others."""
        prompts = prompt_list(prompts)
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (SamplingParams(**your_dict)), "
                f"got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        final_only = with_output_kind(list(sampling_params), RequestOutputKind.FINAL_ONLY)  # it returns only those
        return self._run(prompts, final_only, "generate", use_tqdm, priority)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's API; Hugging Face's num_beams algorithm, see
        beam_search.py): each output holds beam_width sequences, best first, whose `tokens` are
        prompt + output."""
        prompts = prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outputs = self._run(prompts, [params] * len(prompts), "beam search", use_tqdm)
        decode = self.engine.tokenizer
        results = []
        for out in outputs:
            sequences = []
            for c in out.outputs:
                tokens = out.prompt_token_ids + c.token_ids
                text = decode.decode(tokens, skip_special_tokens=True) if decode is not None else None
                score = c.cumulative_logprob / len(c.token_ids) ** params.length_penalty
                beam = BeamSearchSequence(tokens, c.cumulative_logprob, score, text, c.finish_reason, c.stop_reason)
                sequences.append(beam)
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to a conversation (a list of {"role", "content"}
        messages) or to each of a list of conversations, under the tokenizer's chat template.
        Messages are checked as OpenAI's API checks them (model/chat_messages.py): a bad one
        raises ValueError naming it (`messages[1].role: ...`; in a batch `messages[2][1].role`)
        before any conversation is queued."""
        tokenizer = self.engine.tokenizer
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], list):  # a batch
            prompts = [chat_prompt(tokenizer, c, f"messages[{i}]") for i, c in enumerate(messages)]
        else:
            prompts = [chat_prompt(tokenizer, messages)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list, desc: str, use_tqdm: bool, priority=None) -> list[RequestOutput]:
        """Validate every prompt, queue them all, step until they finish; outputs in input order."""
        engine = self.engine
        priority = list(priority) if priority is not None else [0] * len(prompts)
        tokenized = []
        for prompt, sp, prio in zip(prompts, params, priority):
            text, token_ids = engine.tokenize(prompt)
            engine.validate_request(token_ids, sp)
            engine.validate_priority(prio)
            tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = [engine.add_request(p, sp, priority=prio) for p, sp, prio in zip(tokenized, params, priority)]
        wanted, results = set(ids), {}
        with tqdm(total=len(ids), desc=desc, disable=not use_tqdm) as bar:
            while len(results) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                    elif out.finished:
                        self._other_outputs.append(out)
        return [results[i] for i in ids]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); blocks in use stay."""
        self.engine.reset_prefix_cache()

    def take_other_outputs(self) -> list[RequestOutput]:
        """Finished outputs of requests added straight to `self.engine` that a `generate` call
        ran to completion (generate returns only its own); each is handed out once."""
        taken, self._other_outputs = self._other_outputs, []
        return taken
