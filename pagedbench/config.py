"""EngineConfig: every engine setting, once. The one module every room may import."""

import json
from dataclasses import asdict, dataclass, field, fields

# vLLM's kv_cache_dtype names: the one list (backends.base maps each to how its pages are stored).
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")

SPEC_METHODS = ("draft_model", "ngram")

# Hybrid models' gated delta rule (model/delta_rule.py): transformers' torch forms, or flash-linear-attention's.
LINEAR_ATTENTION_KERNELS = ("torch", "fla")
INDEX_CACHE_DTYPES = ("auto", "fp8")  # DeepSeek-V3.2's index keys as stored
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's; a hybrid model at this default runs fewer where its states need (kv_budget)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: `method` "draft_model" (a smaller model of the same vocabulary
    proposes) or "ngram" (prompt lookup: the continuation of the latest earlier match of the
    sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min), and
    num_speculative_tokens (k) proposed per sequence per step."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft (method "draft_model")
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    @classmethod
    def parse(cls, value: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From vLLM's dict (a method may be left out: "model" means draft_model, "[ngram]" or
        "ngram" as the model means ngram); ValueError naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        known_noops = {"draft_tensor_parallel_size": 1, "disable_by_batch_size": None}
        unknown = sorted(set(value) - known - set(known_noops))
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        for key, allowed in known_noops.items():
            if key in value and value[key] != allowed and allowed is not None:
                raise ValueError(f"speculative_config {key} may only be {allowed} here")
        method, model = value.get("method"), value.get("model")
        if model in ("[ngram]", "ngram"):
            method, model = method or "ngram", None
        method = method or ("draft_model" if model else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an int >= 1, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(
                    'speculative_config method "draft_model" needs "model": the draft\'s directory or preset'
                )
            if lo is not None or hi is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method ngram")
            return cls(method, k, model)
        if model is not None:
            raise ValueError(f'speculative_config method "ngram" takes no model, got {model!r}')
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name} must be an int >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min {lo} > prompt_lookup_max {hi}")
        return cls(method, k, None, lo, hi)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def label(self) -> str:
        """What reports call it: `ngram k=3 n=2..4`, `draft py-byte-draft k=3`."""
        if self.method == "ngram":
            return f"ngram k={self.num_speculative_tokens} n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
        return f"draft {self.model.rstrip('/').rsplit('/', 1)[-1]} k={self.num_speculative_tokens}"


def speculation_label(value: "dict | SpeculativeConfig | None") -> str:
    spec = SpeculativeConfig.parse(value)
    return "off" if spec is None else spec.label


def setting(
    default,
    help: str,
    choices: tuple = (),
    minimum: float | None = None,
    maximum: float | None = None,
    workload: bool = True,
):
    """An EngineConfig field with what the CLI, validation and scenarios need to know about it.
    `workload=False`: how the engine runs, not what it computes (outside a scenario's content hash)."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "workload": workload}
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class EngineConfig:
    """Every engine setting, once: its type, default, help, allowed values and minimum drive
    LLM(**kwargs), the CLI flags (`add_cli_args`) and `validate()`."""

    model: str = setting(None, "HF model directory or preset")
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model directory's)")
    load_format: str = setting(
        "auto",
        "auto (the directory's safetensors), or dummy: random weights in the model's shapes, as in vLLM",
        ("auto", "safetensors", "dummy"),
    )
    backend: str = setting("sdpa", "attention backend (see `pagedbench backends`)", workload=False)
    cascade_attention: bool | None = setting(
        None,
        "cascade attention: decoding sequences whose block tables begin with the same full pages (prefix caching, "
        "n > 1 samples) read that shared prefix once per group, merged with each suffix by log-sum-exp; True: every "
        "group of 2+, False: never, None: vLLM's rule, a group of 8+ sequences sharing 256+ tokens, where the backend "
        "is not measured slower with it (flex stays flat; docs/cascade.md)",
        workload=False,
    )
    device: str | None = setting(None, "cuda if available, else cpu", workload=False)
    dtype: str | None = setting(None, "bf16 on cuda, fp32 on cpu", workload=False)
    block_size: int = setting(16, "tokens per KV page", minimum=1)
    num_blocks: int | None = setting(None, "KV pages (default: from free memory)", minimum=1)
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS,
        "sequences running at once (at this default a hybrid model runs as many as its DeltaNet states fit half "
        "the KV budget: docs/hybrid.md)",
        minimum=1,
    )
    max_num_batched_tokens: int = setting(2048, "tokens per engine step", minimum=1)
    max_model_len: int | None = setting(None, "longest sequence (default: the model's, capped by the cache)", minimum=1)
    seed: int | None = setting(
        0,
        "seed of the sampler, of random weights and of a scenario's request set (None: a fresh one)",
        minimum=0,
        maximum=2**63 - 1,
    )
    preset_init: str = setting(
        "decisive",
        "a preset's random weights: decisive (one-hot attention heads, so every correct backend's greedy tokens "
        "are identical) or plain (N(0, 0.02) everywhere)",
        ("decisive", "plain"),
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is sharded over (worker processes; GPUs on cuda)", minimum=1
    )
    pipeline_parallel_size: int = setting(
        1,
        "pipeline stages the layers are split over (worker processes, each with its stage's KV cache; "
        "as many steps in flight as stages)",
        minimum=1,
    )
    pipeline_layer_partition: str | None = setting(
        None, 'layers per pipeline stage, e.g. "3,3,2" (vLLM\'s VLLM_PP_LAYER_PARTITION; default: an even split)'
    )
    data_parallel_size: int = setting(
        1,
        "engine replicas, each a process with its own KV cache and scheduler (and GPUs on cuda); requests go to "
        "the least loaded",
        minimum=1,
    )
    distributed_executor_backend: str = setting(
        "mp",
        "how tensor-parallel ranks start: mp (the engine spawns worker processes) or external_launcher (torchrun "
        "started every rank, each running this same engine; every rank returns the same outputs)",
        ("mp", "external_launcher"),
        workload=False,
    )
    enable_prefix_caching: bool = setting(True, "share the KV pages of common prompt prefixes (vLLM v1's default)")
    mamba_block_size: int | None = setting(
        None,
        "hybrid models' prefix caching: tokens between snapshots of the DeltaNet state, a multiple of block_size "
        "(vLLM's name; None: vLLM's align rule, the fewest pages whose K/V in one attention layer outweighs one "
        "DeltaNet layer's state, so snapshots cost at most what the pages they stand for cost per layer)",
        minimum=1,
    )
    num_state_snapshots: int | None = setting(
        None,
        "hybrid models' prefix caching: DeltaNet state snapshots kept, least recently used evicted first (None: "
        "one per max_num_seqs, within a quarter of the KV cache budget; 0 turns prefix caching off for them)",
        minimum=0,
    )
    linear_attention_kernel: str = setting(
        "torch",
        "hybrid models' gated delta rule (their DeltaNet layers): torch (transformers' torch forms, one sequence "
        "of a step at a time) or fla (flash-linear-attention's Triton kernels, every sequence of a step in one "
        "varlen call; pip install 'pagedbench[fla]'; run by Triton's interpreter on CPU)",
        LINEAR_ATTENTION_KERNELS,
        workload=False,
    )
    scheduling_policy: str = setting("fcfs", "fcfs, or priority: lowest value first", ("fcfs", "priority"))
    preemption_mode: str = setting("recompute", "what preemption does with K/V", ("recompute", "swap"))
    swap_space: float = setting(
        4.0,
        "GiB of CPU memory for swapped-out pages (and, up to half of it, a hybrid model's DeltaNet states)",
        minimum=0,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "share of the GPU's memory this engine may use: weights, activations (profiled), CUDA graphs and "
        "the KV cache, which gets the rest",
        minimum=0,
        maximum=1,
    )
    max_logprobs: int = setting(20, "most logprobs / prompt_logprobs a request may ask for", minimum=0)
    async_scheduling: bool | None = setting(
        None,
        "schedule step N+1 and build its inputs while step N runs on the device, N's sampled tokens fed to N+1 "
        "there and learnt by the host one step late (vLLM's name; docs/async-scheduling.md says what runs "
        "synchronously and why); None: on where it is supported and measured faster (docs)",
        workload=False,
    )
    enforce_eager: bool = setting(
        False,
        "never capture CUDA graphs and never compile the model (vLLM's meaning): every step runs eagerly",
        workload=False,
    )
    compile: bool | None = setting(
        None,
        "torch.compile each layer's elementwise work (norms with their residual adds, q/k norm and RoPE, the "
        "activation, the router) around the opaque attention call; None: on for CUDA, off on CPU (measured: "
        "docs/benchmarks.md); enforce_eager turns it off",
        workload=False,
    )
    batch_invariant: bool = setting(
        False,
        "each request's logprobs bitwise the same alone or in any batch (vLLM's batch-invariant mode): the model's "
        "dense GEMMs in fixed tiles of rows, attention in the backend's batch-invariant form; a backend without one "
        "is refused, saying why (docs/correctness.md: who accepts it, and its cost)",
        workload=False,
    )
    cpu_kv_cache_bytes: int = setting(1 << 30, "KV cache bytes on CPU when num_blocks is None", minimum=1)
    kv_cache_dtype: str = setting(
        "auto",
        "how K/V pages are stored: auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2 (a scale per layer), "
        "int8 (a scale per token and KV head); each backend dequantizes where it reads",
        KV_CACHE_DTYPE_NAMES,
    )
    index_cache_dtype: str = setting(
        "auto",
        "DeepSeek-V3.2's index keys (its sparse-attention indexer's cache): auto (the model's dtype) or fp8 "
        "(e4m3 with a scale per token, as DeepSeek stores them)",
        INDEX_CACHE_DTYPES,
    )
    calculate_kv_scales: bool = setting(
        False, "fp8 KV: set each layer's K and V scales from the first step's K/V (default: 1.0, as vLLM)"
    )
    speculative_config: dict | None = setting(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} '
        'or {"method": "draft_model", "model": "py-byte-draft", "num_speculative_tokens": 3}',
    )
    structured_outputs_config: dict | None = setting(
        None,
        'structured outputs, as JSON (vLLM\'s): {"backend": "xgrammar", "disable_any_whitespace": true} (compact '
        "JSON for every request: a random-weight model may otherwise write whitespace until max_tokens)",
    )

    def validate(self) -> None:
        """TypeError or ValueError naming the field."""
        for f in fields(self):
            value, kinds = getattr(self, f.name), _kinds(f.type)
            if value is None and type(None) in kinds:
                continue
            if f.name in ("device", "dtype") and type(value).__name__ == f.name:
                continue  # a torch.device / torch.dtype is fine too
            ok = any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
            ok = ok or (float in kinds and isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise TypeError(f"{f.name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
            choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be {' or '.join(map(repr, choices))}, got {value!r}")
            if minimum is not None and not value >= minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value}")
            maximum = f.metadata.get("maximum")
            if maximum is not None and not value <= maximum:
                raise ValueError(f"{f.name} must be <= {maximum}, got {value}")
        SpeculativeConfig.parse(self.speculative_config)
        self._check_structured_outputs_config()

    def compiles(self, device) -> bool:
        """Whether the model's layers run compiled on `device` (a torch.device or its type)."""
        if self.enforce_eager:
            return False
        return getattr(device, "type", device) == "cuda" if self.compile is None else self.compile

    @property
    def disable_any_whitespace(self) -> bool:
        """structured_outputs_config's disable_any_whitespace: every JSON constraint compact."""
        return (self.structured_outputs_config or {}).get("disable_any_whitespace", False)

    def _check_structured_outputs_config(self) -> None:
        so = self.structured_outputs_config or {}
        unknown = sorted(set(so) - {"backend", "disable_any_whitespace"})
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown key {unknown[0]!r}; known: backend, disable_any_whitespace"
            )
        if so.get("backend", "xgrammar") not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config backend must be xgrammar (or auto), got {so['backend']!r}")
        if not isinstance(so.get("disable_any_whitespace", False), bool):
            raise ValueError("structured_outputs_config disable_any_whitespace must be true or false")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed and checked."""
        return SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def add_cli_args(cls, parser, skip: tuple[str, ...] = ("model",), unset: str | None = None) -> None:
        """One --flag per field (booleans as --x/--no-x), typed, with its help and choices. With
        `unset` (e.g. "the scenario's") every flag defaults to None: not given, whose value `unset` names."""
        import argparse

        for f in fields(cls):
            if f.name in skip:
                continue
            flag, kind = "--" + f.name.replace("_", "-"), next(k for k in _kinds(f.type) if k is not type(None))
            extra = {"choices": f.metadata["choices"]} if f.metadata.get("choices") else {}
            default, help = f.default, f.metadata["help"]
            if unset is not None:
                default, help = None, f"{help} [unset: {unset}]"
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
            else:
                kind = json_object if kind is dict else kind
                flags = [flag, *CLI_ALIASES.get(f.name, ())]
                parser.add_argument(*flags, type=kind, default=default, help=help, **extra)

    @classmethod
    def given_cli_args(cls, args) -> dict:
        """The settings a command line gave (flags added with `unset`: those not None)."""
        return {name: getattr(args, name) for name in cls.names() if getattr(args, name, None) is not None}

    @classmethod
    def from_cli_args(cls, args, **overrides) -> "EngineConfig":
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)} | overrides)

    @classmethod
    def workload_settings(cls) -> list[str]:
        """The settings that change what the engine computes (a scenario's content hash holds them)."""
        return [f.name for f in fields(cls) if f.metadata["workload"]]


CLI_ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",)}


def _kinds(annotation) -> tuple:
    """`int | None` -> (int, NoneType); `str` -> (str,). Annotations are strings here at times."""
    if isinstance(annotation, str):
        names = [a.strip() for a in annotation.split("|")]
        table = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict, "None": type(None)}
        return tuple(table[n] for n in names)
    return tuple(getattr(annotation, "__args__", (annotation,)))


def json_object(text: str) -> dict:
    """A CLI value that is a JSON object (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


json_object.__name__ = "JSON object"  # what argparse's error says: invalid JSON object value: ...
