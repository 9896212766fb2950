"""Whether an engine's steps run ahead (EngineConfig.async_scheduling): where it is supported, and by
default where it is measured faster. What runs ahead and what waits: engine_core.py and
docs/async-scheduling.md."""

import torch

from pagedbench.config import EngineConfig
from pagedbench.model.config import ModelConfig


def async_scheduling(config: EngineConfig, model: ModelConfig, device: torch.device) -> bool:
    """Whether steps run ahead (EngineConfig.async_scheduling; docs/async-scheduling.md): None means
    where it is supported and measured faster; True where it is not supported is a one-line error."""
    reason = async_unsupported_reason(config, model)
    if config.async_scheduling is None:
        return reason is None and device.type in ASYNC_BY_DEFAULT
    if config.async_scheduling and reason is not None:
        raise ValueError(f"async_scheduling is not supported here: {reason}")
    return config.async_scheduling


ASYNC_BY_DEFAULT = ()  # device types where async scheduling is measured faster (docs/async-scheduling.md)


def async_unsupported_reason(config: EngineConfig, model: ModelConfig) -> str | None:
    if config.speculative_config is not None:
        return "speculative decoding verifies proposals on the host each step"
    if config.pipeline_parallel_size > 1:
        return "pipeline parallelism keeps a step per stage in flight already"
    if config.tensor_parallel_size > 1:
        return "tensor-parallel ranks get each step's token ids from rank 0's host"
    if model.linear is not None:
        return "hybrid models' DeltaNet states are snapshotted per step from the host"
    return None
