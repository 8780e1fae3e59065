"""A source of live values: layer calls, in execution order, each with its flattened outputs.

The comparator meets live calls with golden calls whatever produced them. The hooked eager model
pushes its calls through the comparator's hook callbacks (it also needs each call's start, for
replay); every other source (a second recording; an exported graph or an ONNX Runtime session, run
outside torch's module hooks) yields :class:`LiveCall` objects from a :class:`LiveSource`, and the
comparator consumes them (``Comparator.consume``). Matching, judging and reports do not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from .leaves import Leaf


@dataclass(frozen=True)
class LiveCall:
    """One call of one layer: ``name`` as the golden spells it (the eager module path), ``call``
    its 0-based index among that layer's calls, ``type_name`` the module's class name, and
    ``leaves`` its outputs flattened as :func:`~.leaves.flatten` does (fetched only when the golden
    has this call, so a source can defer reading or copying them). ``only``: the golden output
    paths this call can be judged on (a graph yields only the values that leave a module's scope);
    the golden's other outputs are not comparable, which the source names in its own notes, and
    an empty set marks the call as met without a row. None: every output, as hooks see them."""

    name: str
    call: int
    type_name: str
    leaves: Callable[[], list[Leaf]]
    only: frozenset[str] | None = None


@runtime_checkable
class LiveSource(Protocol):
    """Where live values come from when no module hook runs."""

    def calls(self) -> Iterator[LiveCall]:
        """Every live layer call, in execution order."""
        ...

    def describe(self) -> str:
        """One line for the report's notes: where these values were read from."""
        ...
