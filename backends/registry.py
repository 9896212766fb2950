"""Backends by name: the built-in ones plus any registered under the entry-point group
`pagedbench.backends` (name = "module:Class")."""
from importlib import import_module
from importlib.metadata import entry_points

from pagedbench.backends.base import AttentionBackend

_BUILTIN = {
    "reference": "pagedbench.backends.reference:ReferenceBackend",
    "sdpa": "pagedbench.backends.sdpa:SDPABackend",
    "flex": "pagedbench.backends.flex:FlexBackend",
    "flash-attn": "pagedbench.backends.flash_attn:FlashAttnBackend",
}
_loaded: dict[str, type[AttentionBackend]] = {}


def _targets() -> dict[str, str]:
    targets = dict(_BUILTIN)
    for ep in entry_points(group="pagedbench.backends"):
        targets.setdefault(ep.name, ep.value)
    return targets


def list_backends() -> list[str]:
    return sorted(set(_targets()) | set(_loaded))


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Register a backend class in this process (also usable as a decorator)."""
    _loaded[cls.name] = cls
    return cls


def get_backend(name: str) -> type[AttentionBackend]:
    if name in _loaded:
        return _loaded[name]
    targets = _targets()
    if name not in targets:
        known = sorted(set(targets) | set(_loaded))
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(known)}")
    module, _, attr = targets[name].partition(":")
    _loaded[name] = getattr(import_module(module), attr)
    return _loaded[name]


def available_backends(device, dtype, head_dim: int, block_size: int) -> dict[str, str | None]:
    """Every registered backend -> None if it can run here, else the reason it cannot."""
    return {n: get_backend(n).unavailable_reason(device, dtype, head_dim, block_size) for n in list_backends()}
