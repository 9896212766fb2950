"""Workload scenarios: load and validate a TOML file, scale it, and build its request set.

The request set depends only on the scenario and the model's vocabulary size (numpy's
default_rng from the scenario seed), so every backend and every process gets the same
token ids, lengths and arrival times."""

import dataclasses
import hashlib
import json
import logging
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from pagedbench.bench.datasets import DATASET_NAMES, MAX_REQUEST_TOKENS, load_dataset
from pagedbench.config import EngineConfig
from pagedbench.engine.block_manager import blocks_needed
from pagedbench.sample.sampling_params import SamplingParams, is_int, structured_outputs_params

logger = logging.getLogger(__name__)

ARRIVALS = ("batch", "poisson")
DEFAULT_MODEL = "qwen3-0.6b"  # a scenario's model unless its [engine] table names one
# Settings a command gives, never a scenario: the same work runs on each backend, device and dtype.
COMMAND_SETTINGS = ("backend", "device", "dtype")
# Engine settings every content hash holds; the others only when not at their default, so that
# hashes from before they could be set still match.
ALWAYS_HASHED = (
    "model",
    "block_size",
    "num_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "seed",
)
POSITIVE_SETTINGS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
POSITIVE_SETTINGS += ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
PROMPT_SOURCES = ("random", "python-source", "chat")
CHAT_CONVERSATIONS = "chat-conversations.json"  # in pagedbench.scenarios, written for pagedbench


MAX_PROMPTS = 1_000_000
MAX_WORKLOAD_TOKENS = 1 << 31  # tokens of every request together


@dataclass(slots=True)
class LengthRange:
    """Token lengths drawn uniformly from [min, max] (inclusive); a TOML int means min == max."""

    min: int
    max: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.min, self.max + 1, size=n)

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}-{self.max}"


def default_engine() -> EngineConfig:
    return EngineConfig(model=DEFAULT_MODEL)


@dataclass(slots=True)
class Scenario:
    """A workload (its requests, lengths, arrivals and sampling) and the engine settings it runs
    under: `engine`, an EngineConfig (a TOML file's [engine] table), the same for every backend.
    Engine settings read through as `scenario.<setting>` too."""

    name: str
    description: str
    num_prompts: int
    input_len: LengthRange  # tokens after the shared prefix (vLLM's random dataset)
    output_len: LengthRange
    shared_prefix_len: int = 0  # tokens every prompt starts with
    arrival: str = "batch"  # "batch": all at t=0; "poisson": exponential gaps at request_rate
    request_rate: float | None = None  # requests per second, for poisson arrivals
    n: int = 1  # samples per prompt, forked from one prefill (parallel sampling)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = True
    kv_tokens: int | None = None  # the KV budget as tokens, or as blocks in engine.num_blocks: one of the two
    # "random" token ids (vLLM's random dataset); "python-source": held-out Python source as
    # bytes, for a byte-level model (the trained pair), where a draft has something to predict;
    # "chat": multi-turn conversations (CHAT_CONVERSATIONS) under the model's chat template, each
    # prompt a conversation up to one of its user turns, drawn among those within input_len tokens.
    prompts: str = "random"
    speculation_baseline: bool = False  # also run each backend without speculation, to compare
    # Every request's structured-output constraint: StructuredOutputsParams' fields, e.g. {json = {...}}.
    structured_outputs: dict | None = None
    # A user's own workload (datasets.py, vLLM's names): sharegpt or custom prompts, or a trace's
    # arrivals and lengths, from dataset_path; num_prompts caps the requests taken.
    dataset_name: str | None = None
    dataset_path: str | None = None
    # A dataset's requests longer than the engine's max_model_len: skipped (and counted), not an error.
    skip_long_requests: bool = False
    engine: EngineConfig = field(default_factory=default_engine)

    def __getattr__(self, name: str):
        """An engine setting read as the scenario's own (scenario.block_size is scenario.engine.block_size)."""
        if name in ENGINE_SETTINGS:
            return getattr(self.engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def replace(self, **changes) -> "Scenario":
        """A copy with `changes`, engine settings among them (sent to `engine`), unvalidated."""
        engine = {k: changes.pop(k) for k in list(changes) if k in ENGINE_SETTINGS}
        return dataclasses.replace(self, **changes, engine=dataclasses.replace(self.engine, **engine))

    def validate(self) -> None:
        self._check_engine()
        positive = ["num_prompts"] + [f for f in ("kv_tokens", "request_rate") if getattr(self, f) is not None]
        for field_name in positive:
            if not getattr(self, field_name) > 0:
                self._fail(field_name, f"must be > 0, got {getattr(self, field_name)}")
        for field_name in ("input_len", "output_len"):
            lengths = getattr(self, field_name)
            if not 1 <= lengths.min <= lengths.max:
                self._fail(field_name, f"needs 1 <= min <= max, got min={lengths.min} max={lengths.max}")
        self._check_sizes()
        if self.shared_prefix_len < 0:
            self._fail("shared_prefix_len", f"must be >= 0, got {self.shared_prefix_len}")
        if self.prompts not in PROMPT_SOURCES:
            self._fail("prompts", f"must be one of {', '.join(PROMPT_SOURCES)}, got {self.prompts!r}")
        if self.dataset_name is not None and self.dataset_name not in DATASET_NAMES:
            self._fail("dataset_name", f"must be one of {', '.join(DATASET_NAMES)}, got {self.dataset_name!r}")
        if (self.dataset_name is None) != (self.dataset_path is None):
            self._fail("dataset_name", "and dataset_path go together (--dataset-name NAME --dataset-path FILE)")
        if self.skip_long_requests and self.dataset_name is None:
            self._fail("skip_long_requests", "applies to a dataset's requests (--dataset-name, --dataset-path)")
        if self.prompts == "chat" and self.shared_prefix_len:
            self._fail("shared_prefix_len", "must be 0 with prompts 'chat' (turns of a conversation share theirs)")
        if self.speculation_baseline and self.engine.speculative_config is None:
            self._fail("speculation_baseline", "needs a speculative_config to compare against")
        if self.arrival not in ARRIVALS:
            self._fail("arrival", f"must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if (self.arrival == "poisson") != (self.request_rate is not None):
            self._fail("request_rate", "is required with arrival = 'poisson' and only then")
        if (self.engine.num_blocks is None) == (self.kv_tokens is None):
            self._fail("num_blocks or kv_tokens", "is required, and only one of them (the KV budget)")
        if is_int(self.n) and self.n > self.engine.max_num_seqs:
            self._fail("n", f"must be <= max_num_seqs ({self.engine.max_num_seqs}), got {self.n}")
        if self.structured_outputs is not None:
            try:
                structured_outputs_params(self.structured_outputs)
            except (TypeError, ValueError) as e:  # a message naming structured_outputs(.field) already
                field_name, _, message = str(e).partition(" ")
                if not field_name.startswith("structured_outputs"):
                    field_name, message = "structured_outputs", str(e)
                self._fail(field_name, message)
        try:
            self.sampling_params(1)
        except ValueError as e:
            self._fail("sampling", str(e))

    def _check_engine(self) -> None:
        """The engine section through EngineConfig's own validation, plus what a scenario needs of it."""
        given = [name for name in COMMAND_SETTINGS if getattr(self.engine, name) != ENGINE_DEFAULTS[name]]
        if given:
            self._fail(given[0], f"is the command's (--{given[0]}), not a scenario's: the same work runs on each")
        if self.engine.model is None:
            self._fail("model", "is required")
        for name in POSITIVE_SETTINGS:  # (a scenario's message for these since before its [engine] table)
            value = getattr(self.engine, name)
            if is_int(value) and value <= 0:
                self._fail(name, f"must be > 0, got {value}")
        if not is_int(self.engine.seed):  # the request set's seed: the same requests in every process
            self._fail("seed", f"must be an int, got {self.engine.seed!r}")
        try:
            self.engine.validate()
        except (TypeError, ValueError) as e:
            field_name, _, message = str(e).partition(" ")
            self._fail(field_name, message)

    def _check_sizes(self) -> None:
        """Sane maxima, before any request array is built (--num-prompts 10**12 fails at once)."""
        if self.num_prompts > MAX_PROMPTS:
            self._fail("num_prompts", f"must be <= {MAX_PROMPTS:,}, got {self.num_prompts:,}")
        if self.longest_request > MAX_REQUEST_TOKENS:
            longest = f"{self.longest_request:,}"
            self._fail("input_len + output_len", f"must be <= {MAX_REQUEST_TOKENS:,} tokens per request, got {longest}")
        if self.num_prompts * self.longest_request > MAX_WORKLOAD_TOKENS:
            self._fail("num_prompts x lengths", f"must be <= {MAX_WORKLOAD_TOKENS:,} tokens in all")

    def _fail(self, field: str, message: str):
        _fail(self.name, field, message)

    @property
    def label(self) -> str:
        """What reports call the workload: `<dataset_name>:<file stem>` for a user's dataset (e.g.
        custom:prompts), else the scenario's name."""
        if self.dataset_name is None:
            return self.name
        return f"{self.dataset_name}:{Path(self.dataset_path).stem}"

    @property
    def kv_blocks(self) -> int:
        if self.engine.num_blocks is not None:
            return self.engine.num_blocks
        return blocks_needed(self.kv_tokens, self.engine.block_size)

    @property
    def longest_request(self) -> int:
        return self.shared_prefix_len + self.input_len.max + self.output_len.max

    @property
    def largest_request_tokens(self) -> int:
        """KV tokens of the largest request at full length: its prompt once, each sample's output."""
        return self.shared_prefix_len + self.input_len.max + self.n * self.output_len.max

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            detokenize=False,  # runs compare token ids: no text work in the step (vLLM's --disable-detokenize)
            structured_outputs=None if self.structured_outputs is None else dict(self.structured_outputs),
        )

    @property
    def structured_label(self) -> str:
        """The constraint every request follows ("json", "regex", ...), or "off"."""
        return "off" if self.structured_outputs is None else structured_outputs_params(self.structured_outputs).kind

    def scaled(self, factor: float) -> "Scenario":
        """Request counts, lengths and max_num_seqs times `factor`, the KV budget times
        factor² (demand is count x length, so memory pressure stays), never below one
        longest request."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale must be a positive number, got {factor}")
        if factor == 1:
            return self.replace()

        def times(n: int, f: float = factor) -> int:
            return max(1, round(n * f))

        out = self.replace(
            num_prompts=times(self.num_prompts),
            max_num_seqs=max(self.n, times(self.engine.max_num_seqs)),
            input_len=LengthRange(times(self.input_len.min), times(self.input_len.max)),
            output_len=LengthRange(times(self.output_len.min), times(self.output_len.max)),
            shared_prefix_len=round(self.shared_prefix_len * factor),
            max_model_len=self.engine.max_model_len and times(self.engine.max_model_len),
        )
        floor = blocks_needed(out.largest_request_tokens, self.engine.block_size) + self.n  # + a private last page each
        out.engine.num_blocks, out.kv_tokens = max(floor, times(self.kv_blocks, factor**2)), None
        return out

    def content_hash(self) -> str:
        """sha256 of the canonical form: the workload's fields but name and description, and the
        engine settings that change what it computes (EngineConfig's workload settings: ALWAYS_HASHED,
        the others only where not at their default, so that hashes from before they existed still
        match), flat, sorted keys, the KV budget in blocks however it was given."""
        content = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("name", "description", "engine"):
            del content[name]
        for name in ("input_len", "output_len"):
            content[name] = dataclasses.asdict(content[name])
        for name in EngineConfig.workload_settings():
            value = getattr(self.engine, name)
            if name in ALWAYS_HASHED or value != ENGINE_DEFAULTS[name]:
                content[name] = value
        content |= {"num_blocks": self.kv_blocks, "kv_tokens": None}
        if self.dataset_path is not None:  # the file's content is the workload, wherever it lies
            content["dataset_path"] = _file_sha256(self.dataset_path)
        defaults = {"dataset_name": None, "dataset_path": None, "prompts": "random", "structured_outputs": None}
        for name, default in (defaults | {"speculation_baseline": False, "skip_long_requests": False}).items():
            if content[name] == default:  # hashes from before these fields existed still match
                del content[name]
        if "structured_outputs" in content:  # its JSON schema's key order is part of the workload
            content["structured_outputs"] = json.dumps(content["structured_outputs"])
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # seconds after the run starts


def _file_sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return path  # a missing file fails where it is read, naming it


def build_requests(
    scenario: Scenario, vocab_size: int, tokenizer=None, max_model_len: int | None = None
) -> list[Request]:
    """The scenario's request set; the same in every process for the same seed and vocabulary
    (and, for prompts "chat", the model's tokenizer, whose chat template formats them). A
    dataset's requests are each checked against `max_model_len` (the engine's) as they are read."""
    if scenario.dataset_name is not None:
        return _dataset_requests(scenario, vocab_size, tokenizer, max_model_len)
    rng = np.random.default_rng(scenario.engine.seed)
    n = scenario.num_prompts
    prefix = rng.integers(0, vocab_size, size=scenario.shared_prefix_len).tolist()
    input_lens = scenario.input_len.sample(rng, n)
    output_lens = scenario.output_len.sample(rng, n)
    if scenario.prompts == "python-source":
        prefix, bodies = _python_source(scenario, rng, input_lens, vocab_size, tokenizer)
    elif scenario.prompts == "chat":
        bodies = _chat(scenario, rng, tokenizer)
    else:
        tokens = rng.integers(0, vocab_size, size=int(input_lens.sum()))
        bodies = np.split(tokens, np.cumsum(input_lens)[:-1])
    if scenario.arrival == "poisson":
        gaps = rng.exponential(1.0 / scenario.request_rate, size=n)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    else:
        arrivals = np.zeros(n)
    return [
        Request(prefix + body.tolist(), scenario.sampling_params(int(out)), float(t))
        for body, out, t in zip(bodies, output_lens, arrivals)
    ]


def _dataset_requests(scenario: Scenario, vocab_size: int, tokenizer, max_model_len: int | None) -> list[Request]:
    """A dataset's prompts and output lengths; a trace's own arrivals, else the scenario's."""
    loaded = load_dataset(
        scenario.dataset_name,
        scenario.dataset_path,
        scenario.num_prompts,
        vocab_size,
        tokenizer,
        scenario.engine.seed,
        max_model_len,
        scenario.skip_long_requests,
    )
    if scenario.arrival == "poisson" and loaded[0].arrival_time is None:
        gaps = np.random.default_rng(scenario.engine.seed).exponential(1.0 / scenario.request_rate, size=len(loaded))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    else:
        arrivals = [r.arrival_time or 0.0 for r in loaded]
    return [
        Request(r.prompt_token_ids, scenario.sampling_params(r.output_len), float(t)) for r, t in zip(loaded, arrivals)
    ]


def model_requests(scenario: Scenario, config, path, max_model_len: int | None = None) -> list[Request]:
    """build_requests for the resolved model (`config`, its directory `path` or None for a
    preset), loading its tokenizer only for prompts that need it; a dataset's requests within
    `max_model_len` (the engines'; None: only a sane maximum)."""
    from pagedbench.model.tokenizer import tokenizer_for
    from pagedbench.model.trained_pair import VOCAB

    # Python source is bytes for the byte-level pair and presets, a real model's own tokens for it.
    real_tokens = scenario.prompts == "python-source" and path is not None and config.vocab_size > VOCAB
    tokenizer = None
    text_dataset = scenario.dataset_name in ("sharegpt", "custom")
    if scenario.prompts == "chat" or real_tokens or text_dataset:
        tokenizer = tokenizer_for(None, path, config.vocab_size, config.eos_token_ids)
    return build_requests(scenario, config.vocab_size, tokenizer, max_model_len)


def _python_source(
    scenario: Scenario, rng, input_lens, vocab_size: int, tokenizer=None
) -> tuple[list[int], list[np.ndarray]]:
    """Held-out Python source (trained_pair.corpus), as bytes or, given a model's tokenizer, its
    tokens: a shared prefix from its start, and each body from a random place."""
    from pagedbench.model.trained_pair import corpus, held_out_tokens

    text = corpus()[1]
    if tokenizer is not None:
        starts = rng.integers(0, len(text) - 16 * int(input_lens.max()), size=len(input_lens))
        prefix = held_out_tokens(tokenizer, [0], [scenario.shared_prefix_len])[0] if scenario.shared_prefix_len else []
        return prefix, [np.array(ids, dtype=np.int64) for ids in held_out_tokens(tokenizer, starts, input_lens)]
    if vocab_size < 256:
        raise ValueError(f"scenario {scenario.name!r}: prompts 'python-source' are bytes, for a byte-level model")
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    starts = rng.integers(0, len(ids) - int(input_lens.max()), size=len(input_lens))
    return ids[: scenario.shared_prefix_len].tolist(), [ids[s : s + n] for s, n in zip(starts, input_lens)]


def chat_conversations() -> list[list[dict]]:
    """The conversations of prompts "chat": OpenAI-style messages, each ending with a user turn."""
    return json.loads(resources.files("pagedbench.scenarios").joinpath(CHAT_CONVERSATIONS).read_text())


def _chat(scenario: Scenario, rng, tokenizer) -> list[np.ndarray]:
    """Token ids of num_prompts chat prompts: every conversation cut after each of its user turns,
    under the tokenizer's chat template with the assistant's turn opened; those within input_len,
    in a seeded order, each once before any repeats."""
    from pagedbench.model.tokenizer import chat_prompt

    if tokenizer is None:
        raise ValueError(f"scenario {scenario.name!r}: prompts 'chat' need the model's tokenizer and chat template")
    pool = []
    for conversation in chat_conversations():
        for turn, message in enumerate(conversation):
            if message["role"] == "user":
                try:
                    ids = chat_prompt(tokenizer, conversation[: turn + 1])["prompt_token_ids"]
                except ValueError as e:
                    raise ValueError(f"scenario {scenario.name!r}: prompts 'chat': {e}") from None
                if scenario.input_len.min <= len(ids) <= scenario.input_len.max:
                    pool.append(np.array(ids, dtype=np.int64))
    if not pool:
        raise ValueError(
            f"scenario {scenario.name!r}: no chat prompt is {scenario.input_len} tokens long under this model's "
            "chat template (input_len bounds the prompts drawn)"
        )
    order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-scenario.num_prompts // len(pool)))])
    return [pool[i] for i in order[: scenario.num_prompts]]


# ---- loading ------------------------------------------------------------------------------

ENGINE_SETTINGS = frozenset(EngineConfig.names())
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_FIELDS = {f.name: f for f in dataclasses.fields(Scenario)}
_FILE_FIELDS = [name for name in _FIELDS if name not in ("name", "engine")]  # the file's stem names it


def builtin_scenarios() -> dict[str, Path]:
    """name -> TOML file shipped in pagedbench.scenarios."""
    root = resources.files("pagedbench.scenarios")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a TOML file by path."""
    builtin = builtin_scenarios()
    if name_or_path in builtin:
        path = builtin[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"scenario {name_or_path!r} is neither a file nor a built-in scenario ({', '.join(sorted(builtin))})"
            )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"scenario file {str(path)!r} is not valid TOML: {e}") from None
    return parse_scenario(data, path.stem)


def parse_scenario(data: dict, name: str) -> Scenario:
    """A scenario from a TOML file's tables: the workload's fields at the top, engine settings
    (EngineConfig's names) in [engine]. Engine settings at the top level, as files had them before
    the [engine] table, are read as engine settings, with a note."""
    data = dict(data)
    engine = data.pop("engine", {})
    if not isinstance(engine, dict):
        _fail(name, "engine", f"must be a table of engine settings, got {engine!r}")
    flat = [key for key in data if key in ENGINE_SETTINGS]
    if flat:
        logger.warning(f"scenario {name!r}: {', '.join(flat)} belong in its [engine] table; read as engine settings")
        engine = {key: data.pop(key) for key in flat} | engine
    unknown = sorted(set(data) - set(_FILE_FIELDS))
    if unknown:
        known = ", ".join(_FILE_FIELDS)
        _fail(name, unknown[0], f"is not a scenario field (known: {known}; engine settings go in [engine])")
    unknown = sorted(set(engine) - ENGINE_SETTINGS)
    if unknown:
        _fail(name, f"engine.{unknown[0]}", "is not an engine setting (EngineConfig's names: pagedbench run --help)")
    missing = [f for f in _FILE_FIELDS if _FIELDS[f].default is dataclasses.MISSING and f not in data]
    if missing:
        _fail(name, missing[0], "is required")
    values = {field_name: _typed(name, field_name, value) for field_name, value in data.items()}
    scenario = Scenario(name=name, **values, engine=EngineConfig(**{"model": DEFAULT_MODEL} | engine))
    scenario.validate()
    return scenario


def _fail(scenario: str, field: str, message: str):
    raise ValueError(f"scenario {scenario!r}: {field} {message}")


def _typed(scenario: str, field: str, value):
    """`value` as the type `field` declares; a one-line error naming the field when it is not."""
    declared = _FIELDS[field].type
    if declared is LengthRange:
        if is_int(value):
            return LengthRange(value, value)
        if isinstance(value, dict) and set(value) == {"min", "max"} and all(map(is_int, value.values())):
            return LengthRange(value["min"], value["max"])
        _fail(scenario, field, f"must be an integer or {{min = ..., max = ...}} of integers, got {value!r}")
    kinds = [t for t in getattr(declared, "__args__", (declared,)) if t is not type(None)]
    kind = kinds[0]
    if (
        kind is int
        and is_int(value)
        or kind is bool
        and isinstance(value, bool)
        or kind is str
        and isinstance(value, str)
    ):
        return value
    if kind is float and (is_int(value) or isinstance(value, float)):
        return float(value)
    if kind is dict and isinstance(value, dict):
        return value
    _fail(scenario, field, f"must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}")
