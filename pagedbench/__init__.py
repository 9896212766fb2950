"""pagedbench: a vLLM-style inference engine whose only swappable part is the paged-attention backend."""

from pagedbench.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedbench.config import EngineConfig
from pagedbench.engine import LLMEngine
from pagedbench.llm import LLM
from pagedbench.outputs import CompletionOutput, Logprob, RequestOutput
from pagedbench.sampling_params import SamplingParams

EngineArgs = EngineConfig  # vLLM's name: LLMEngine.from_engine_args(EngineArgs(model=...))

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineArgs",
    "Logprob",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"
