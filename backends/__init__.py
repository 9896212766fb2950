"""Paged-attention backends: the one swappable part of the engine."""

from pagedbench.backends.base import AttentionBackend, AttentionMetadata, write_kv
from pagedbench.backends.registry import get_backend, list_backends

__all__ = ["AttentionBackend", "AttentionMetadata", "write_kv", "get_backend", "list_backends"]
