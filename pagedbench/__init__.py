"""pagedbench: a vLLM-style inference engine whose only swappable part is the paged-attention backend."""

import importlib.metadata

from pagedbench.config import EngineConfig
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedbench.entrypoints.llm import LLM
from pagedbench.sample.sampling_params import (
    BatchLogitsProcessor,
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

EngineArgs = EngineConfig  # vLLM's name: LLMEngine.from_engine_args(EngineArgs(model=...))

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineArgs",
    "Logprob",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "BatchLogitsProcessor",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = importlib.metadata.version("pagedbench")
