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
_loaded: dict[str, type[AttentionBackend]] = {}  # imported classes by name


def _targets() -> dict[str, str]:
    targets = dict(_BUILTIN)
    for ep in entry_points(group="pagedbench.backends"):
        targets.setdefault(ep.name, ep.value)
    return targets


def list_backends() -> list[str]:
    return sorted(_targets())


def get_backend(name: str) -> type[AttentionBackend]:
    if name in _loaded:
        return _loaded[name]
    targets = _targets()
    if name not in targets:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(targets))}")
    module, _, attr = targets[name].partition(":")
    _loaded[name] = getattr(import_module(module), attr)
    return _loaded[name]

