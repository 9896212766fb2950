"""Structured outputs through xgrammar: each distinct constraint compiled once (cached, thread-safe,
so the server compiles off the event loop and the step loop), a grammar matcher per sequence that
advances with its tokens, and each step's token bitmask, filled for every constrained row in one
batched call and applied to the logits on the device in one operation.

A matcher forks with its sequence (n > 1 samples) and needs no rollback: preemption keeps a
sequence's tokens, and speculative verification judges each proposed position with a fork of the
matcher advanced by the proposals before it (`lookahead`), so rejected tokens never reach the
sequence's own matcher."""

import dataclasses
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

import torch

from pagedbench.device.timer import DeviceTimer
from pagedbench.device.transfer import to_device
from pagedbench.engine.stats import EngineStats
from pagedbench.sample.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
INSTALL_HINT = 'structured outputs need xgrammar: pip install -e ".[structured]"'
MAX_CACHED_GRAMMARS = 1024  # distinct constraints kept compiled (a server may see a new schema per request)
COMPILER_CACHE_BYTES = 512 << 20  # xgrammar's own cache, as vLLM bounds it
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")
# JSON string characters as xgrammar (0.2.8) writes them: in plain strings, in strings with minLength/
# maxLength (mlc-ai/xgrammar#800: control characters let through) and in its builtin JSON grammar.
# Each also admits a UTF-8-encoded surrogate (ED A0..BF xx), which is not UTF-8 at all: a decoder makes
# it three U+FFFD, past maxLength. The engine writes every one as the strict class below instead.
_JSON_STRING_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]", r"[^\"\\\0-\x1f]")
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\ud800-\udfff]"


def xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


@dataclass(slots=True)
class GrammarMask:
    """A step's grammar mask: bitmask [B, ceil(V / 32)] int32 on the device, filled on `rows`."""

    rows: list[int]
    bitmask: torch.Tensor
    timer: DeviceTimer

    def apply(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place and in one operation, every logit [B, V] of a constrained row that
        its grammar forbids (timed as the step's "grammar" device span)."""
        start = self.timer.mark()
        xgrammar().apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)
        self.timer.span("grammar", start)


class StructuredOutputManager:
    """The engine's grammars: compile and check a request's constraint, give each sequence its
    matcher, and build a step's bitmask. Built lazily: an engine without a constrained request
    never imports xgrammar."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        stats: EngineStats,
        timer: DeviceTimer,
        disable_any_whitespace: bool = False,
    ):
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.device = tokenizer, vocab_size, eos_token_ids, device
        self.stats, self.timer = stats, timer
        self.disable_any_whitespace = disable_any_whitespace  # the engine's default (structured_outputs_config)
        # xgrammar's worker threads wait busily: on CPU, where torch's threads use every core, they
        # made steps 10x slower (measured on 2 cores); on a GPU host a few spare cores fill masks.
        self.threads = 1 if device.type == "cpu" else max(1, min(4, (os.cpu_count() or 2) // 4))
        self._compiler = None
        self._compiled: dict[tuple, object] = {}  # constraint key -> CompiledGrammar, oldest first
        self._lock = threading.Lock()
        self._batch_matcher = None
        self._special_ids: set[int] = set()  # ids no grammar accepts (special, or past the tokenizer's vocabulary)
        self._host_bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, reused (pinned on CUDA)
        self.num_compiled = 0

    def _compiler_for_model(self):
        xgr = xgrammar()
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_limit_bytes=COMPILER_CACHE_BYTES)
            self._special_ids = set(info.special_token_ids) - set(info.stop_token_ids)
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self.threads)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The constraint's CompiledGrammar (compiled once per distinct constraint). ValueError in one
        line for a constraint xgrammar refuses, or one no token sequence can start (an unsatisfiable
        regex)."""
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params = dataclasses.replace(params, disable_any_whitespace=True)
        key = constraint_key(params)
        compiled = self._compiled.get(key)  # a hit never waits behind another thread's compile
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                return compiled
            compiler = self._compiler_for_model()
            start = time.perf_counter()
            try:
                compiled = _compile(compiler, params)
            except (RuntimeError, ValueError, TypeError) as e:
                message = _XGRAMMAR_PREFIX.sub("", (str(e).strip().splitlines() or [type(e).__name__])[0]).strip()
                raise ValueError(f"structured_outputs.{params.kind}: {message}") from None
            self.stats.grammar_compile_s += time.perf_counter() - start
            self._check_satisfiable(compiled, params)
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:  # the oldest compiled goes first
                del self._compiled[next(iter(self._compiled))]
            self.num_compiled += 1
            return compiled

    def _check_satisfiable(self, compiled, params: StructuredOutputsParams) -> None:
        xgr = xgrammar()
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()) and not matcher.is_terminated():
            raise ValueError(f"structured_outputs.{params.kind}: no output the tokenizer can produce satisfies it")

    def matcher(self, params: StructuredOutputsParams):
        """A new matcher of the constraint, at its start."""
        return xgrammar().GrammarMatcher(self.compile(params))

    def mask(self, seqs) -> GrammarMask | None:
        """The step's grammar mask for `seqs` (row i for seqs[i]; a row's matcher is `seqs[i].grammar`),
        filled for every constrained row in one batched call (its host time counted in the stats), or
        None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return None
        start = time.perf_counter()
        width = (self.vocab_size + 31) // 32
        if self._host_bitmask is None or len(self._host_bitmask) < len(seqs):
            size = max(len(seqs), 2 * len(self._host_bitmask) if self._host_bitmask is not None else 0)
            pin = self.device.type == "cuda"
            self._host_bitmask = torch.empty(size, width, dtype=torch.int32, pin_memory=pin)
        bitmask = self._host_bitmask[: len(seqs)]
        self._batch_matcher.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], bitmask, rows)
        mask = GrammarMask(rows, to_device(bitmask, self.device), self.timer)
        self.stats.grammar_fill_s += time.perf_counter() - start
        self.stats.grammar_rows += len(rows)
        return mask

    def lookahead(self, matcher, proposed: list[int]) -> list:
        """The m + 1 grammar states that verify `proposed` (m speculated tokens): the matcher itself,
        then forks advanced by proposals 1..j. Past a proposal the grammar refuses (which the row
        before rejects, so later rows go unused) or the grammar's end, a row gets a copy of the last
        state reached, so no row has nothing allowed; every row has its own matcher (a batched fill
        must not see one twice). A token outside the tokenizer's vocabulary is refused without asking
        xgrammar, which would log a warning for it."""
        states, stuck = [matcher], False
        for token in proposed:
            state = states[-1].fork()
            if not stuck and (token in self._special_ids or not state.accept_token(token) or state.is_terminated()):
                stuck, state = True, states[-1].fork()
            states.append(state)
        return states


def advance(seq, token: int) -> bool:
    """Move `seq`'s matcher past its new `token`. False when the grammar has ended (its stop token
    accepted, or nothing may follow) or refuses the token: the constrained output is complete, or
    cannot go on. A refused token means the request's other settings overrode the grammar's mask (a
    logits processor re-allowed a token, or allowed_token_ids / bad_words left none it allows):
    logged, since the output then breaks its constraint."""
    matcher = seq.grammar
    if matcher.is_terminated():
        return False
    if not matcher.accept_token(token):
        logger.warning(
            "request %s: token %d breaks its structured-output constraint (its logits processors, "
            "allowed_token_ids or bad_words overrode the grammar); the output ends here",
            seq.request_id,
            token,
        )
        return False
    return not matcher.is_terminated()


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """What identifies a compiled grammar: the constraint and the options that change it. A JSON
    schema's key order is part of it (its property order is the output's), so two schemas that
    differ only in key order are compiled apart."""
    return (params.kind, _spec_text(params), params.disable_any_whitespace)


def _spec_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "json":
        return json_schema_text(params.json)
    if kind == "choice":
        return json.dumps(params.choice)
    if kind == "json_object":
        return ""
    return getattr(params, kind)


def json_schema_text(schema) -> str:
    """A JSON schema (dict, JSON string or pydantic model class) as JSON text, re-serialized (the given
    whitespace does not matter) in the schema's own key order; ValueError for text that is not JSON.
    The order is kept, not sorted: xgrammar writes an object's properties in the order of its
    `properties`, and OpenAI and vLLM keep the schema's order (a "reasoning" property before an
    "answer"). A pydantic model's schema lists its fields as declared; a JSON string's order is its
    text's."""
    if isinstance(schema, type):  # a pydantic BaseModel subclass, as vLLM accepts
        if not hasattr(schema, "model_json_schema"):
            raise ValueError(f"structured_outputs.json: {schema.__name__} is not a pydantic model class")
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("structured_outputs.json: nested too deeply to read") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema)  # never sort_keys: the order of `properties` is the output's
    except RecursionError:
        raise ValueError("structured_outputs.json: nested too deeply to read") from None


def strict_json_strings(ebnf: str) -> str:
    """An xgrammar JSON grammar whose strings take only what strict JSON and UTF-8 allow."""
    for chars in _JSON_STRING_CHARS:
        ebnf = ebnf.replace(chars, _STRICT_STRING_CHAR)
    return ebnf


def _compile(compiler, params: StructuredOutputsParams):
    kind = params.kind
    if kind in ("json", "json_object"):  # json_object: any JSON object, as vLLM and OpenAI
        schema = json_schema_text(params.json) if kind == "json" else '{"type": "object"}'
        grammar = xgrammar().Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
        return compiler.compile_grammar(strict_json_strings(str(grammar)))
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":  # one EBNF alternative per choice, each a JSON-escaped string literal
        literals = (json.dumps(c, ensure_ascii=False) for c in params.choice)  # no \ud83d\ude00 surrogate pairs
        return compiler.compile_grammar("root ::= " + " | ".join(literals))
    if "::=" in params.grammar:  # EBNF / GBNF, xgrammar's own form
        return compiler.compile_grammar(params.grammar)
    return compiler.compile_lark(params.grammar)
