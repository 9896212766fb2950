"""Backends by name: the built-in ones plus any registered under the entry-point group
`pagedbench.backends` (name = "module:Class").

Probing never crashes: a backend whose module fails to import, or whose `provider()` or
`unavailable_reason()` raises, is reported as unavailable with that error as its reason, and
every other backend stays usable."""

from importlib import import_module
from importlib.metadata import entry_points
from typing import NamedTuple

import torch
from pagedbench.backends.base import AttentionBackend, one_line

_BUILTIN = {
    "reference": "pagedbench.backends.reference:ReferenceBackend",
    "sdpa": "pagedbench.backends.sdpa:SDPABackend",
    "flex": "pagedbench.backends.flex:FlexBackend",
    "flash-attn": "pagedbench.backends.flash_attn:FlashAttnBackend",
    "triton": "pagedbench.backends.triton:TritonBackend",
    "flashinfer": "pagedbench.backends.flashinfer:FlashInferBackend",
}
_loaded: dict[str, type[AttentionBackend]] = {}  # imported classes by name


def _targets() -> dict[str, str]:
    targets = dict(_BUILTIN)
    try:
        found = entry_points(group="pagedbench.backends")
    except Exception:  # a broken distribution's metadata must not hide the built-in backends
        found = []
    for ep in found:
        targets.setdefault(ep.name, ep.value)
    return targets


def list_backends() -> list[str]:
    return sorted(_targets())


def _broken_backend(name: str, target: str, error: str) -> type[AttentionBackend]:
    """A stand-in for a backend that failed to load: always unavailable, saying why."""

    class BrokenBackend(AttentionBackend):
        @classmethod
        def unavailable_reason(cls, *args, **kwargs) -> str:
            return f"failed to load {target}: {error}"

        @classmethod
        def provider(cls, **settings) -> str:
            return "none"

        def __init__(self, *args, **kwargs):
            raise ValueError(f"backend {name!r} is unavailable: {self.unavailable_reason()}")

        def plan(self, meta):
            raise NotImplementedError

        def forward(self, q, k_cache, v_cache, state):
            raise NotImplementedError

    BrokenBackend.name = name
    return BrokenBackend


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; a stand-in that reports the error when its module
    cannot be imported. Unknown names are a ValueError."""
    if name in _loaded:
        return _loaded[name]
    targets = _targets()
    if name not in targets:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(targets))}")
    module, _, attr = targets[name].partition(":")
    try:
        cls = getattr(import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"{attr} is not an AttentionBackend subclass")
    except Exception as e:  # anything a third-party or optional dependency raises at import
        cls = _broken_backend(name, targets[name], one_line(e))
    _loaded[name] = cls
    return cls


def loads_by_name(name: str) -> bool:
    """Whether a fresh process loading `name` gets the class this one has (not one set at run time)."""
    cls = _loaded.get(name)
    return cls is None or f"{cls.__module__}:{cls.__qualname__}" == _targets().get(name)


class Resolved(NamedTuple):
    """What `resolve` found: the class, its provider, and why it cannot run here (None: it can)."""

    name: str
    cls: type[AttentionBackend]
    provider: str
    reason: str | None

    @property
    def runnable(self) -> bool:
        return self.reason is None


def resolve(
    name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int, **settings
) -> Resolved:
    """The one call for "can backend `name` run these settings here?": its class (a stand-in if
    it failed to import), provider and unavailable reason. An unknown name is a ValueError."""
    cls = get_backend(name)
    return Resolved(name, cls, *probe(cls, device, dtype, head_dim, block_size, **settings))


def probe(
    cls: type[AttentionBackend],
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    **settings,
) -> tuple[str, str | None]:
    """(provider, unavailable reason or None) of a backend class for these settings; an exception
    raised by either classmethod becomes the reason."""
    try:
        provider = cls.provider(device=device, dtype=dtype, head_dim=head_dim, block_size=block_size, **settings)
    except Exception as e:
        provider = f"none ({one_line(e)})"
    try:
        reason = cls.unavailable_reason(device, dtype, head_dim, block_size, **settings)
        reason = reason or cls.kv_cache_reason(**settings) or cls.latent_reason(**settings)
        reason = reason or cls.sparse_reason(**settings) or cls.cascade_reason(**settings)
    except Exception as e:
        reason = f"probing failed: {one_line(e)}"
    return provider, reason
