"""Paged-attention backends: the one swappable part of the engine."""
from pagedbench.backends.base import AttentionBackend, AttentionMetadata, write_kv
from pagedbench.backends.registry import available_backends, get_backend, list_backends

__all__ = ["AttentionBackend", "AttentionMetadata", "write_kv", "available_backends", "get_backend", "list_backends"]
