"""pagedbench: a vLLM-style inference engine whose only swappable part is the paged-attention backend."""

from pagedbench.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedbench.config import EngineConfig
from pagedbench.engine import LLMEngine
from pagedbench.llm import LLM
from pagedbench.outputs import CompletionOutput, RequestOutput
from pagedbench.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"
