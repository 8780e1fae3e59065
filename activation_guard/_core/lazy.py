"""Names a package imports on first use (PEP 562), so importing it stays cheap: the facade's public
names, and the store's, which the pytest plugin reaches without importing h5py or torch."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable


def lazy_names(package: str, names: Mapping[str, str],
               namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``names`` maps a public name to the submodule
    (relative to ``package``) that defines it; a name is imported once, then kept in ``namespace``
    (the package's globals)."""

    def __getattr__(name: str) -> Any:
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{mod}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
