"""Keep the cyclic garbage collector off the objects that were alive before a record or compare.

The model, torch's own modules and a golden's parsed index are hundreds of thousands of tracked
objects, and none of them becomes this run's garbage, yet every full collection rescans them all.
Per-layer work allocates steadily, so on a model of thousands of small layers those rescans were
about a third of the whole cost, and grew faster than the layer count (compare on 3,000
``Linear(8, 8)``: 3.6x the time of 1,500). Freezing moves them out of the collector's sight for the
duration; objects created meanwhile are still collected as usual.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable[..., object])

# The freeze is process-wide: how many of our blocks hold it (a nested block freezes what the outer
# one created since, e.g. a parsed index before the forward; the outermost one unfreezes)
_held = 0
_lock = threading.Lock()


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Freeze the objects alive now until the block ends; a no-op when the collector is disabled
    or a caller froze objects itself: their choice stands."""
    global _held
    with _lock:
        ours = _held > 0 or (gc.isenabled() and not gc.get_freeze_count())
        if ours:
            gc.freeze()
            _held += 1
    try:
        yield
    finally:
        if ours:
            with _lock:
                _held -= 1
                if _held == 0:
                    gc.unfreeze()


def with_frozen_gc(fn: F) -> F:
    """``fn`` run inside :func:`frozen_gc`."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        with frozen_gc():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_off = 0


@contextmanager
def collector_off() -> Iterator[None]:
    """No collection while the block builds a large graph of containers that cannot form
    cycles (a golden's parsed index: JSON dicts and lists, and the entries made from them).

    Inside :func:`frozen_gc` the collector sees only the objects made since the freeze, so a
    full collection comes every few thousand allocations, and each rescans everything parsed so
    far: on a golden of 1,500 layer calls that was ~5 us per call of a compare's opening. The
    collector is switched back on when the outermost block ends, if it was on before. Like the
    freeze, the switch is process-wide: another thread that calls ``gc.disable()`` while a golden
    is being opened finds the collector on again afterwards (the parse takes milliseconds).

    Inside :func:`frozen_gc` (a compare opens its golden there) what the block built is frozen
    when it ends: switched back on with tens of thousands of new containers in its youngest
    generation, the collector scanned the whole parsed index at the next allocation, and again
    as it aged (~0.6 us per layer call of a compare on `deep`). Frozen, it stays out of sight
    until the outermost freeze ends, as the model does; being acyclic, it is freed by reference
    counting either way. (``gc.freeze`` takes every tracked object: cyclic garbage made earlier
    in the block waits for its end too, when it is collected as usual.)"""
    global _off
    with _lock:
        ours = _off > 0 or gc.isenabled()
        if ours:
            _off += 1
            gc.disable()
    try:
        yield
    finally:
        if ours:
            with _lock:
                _off -= 1
                if _off == 0:
                    if _held > 0:
                        gc.freeze()
                    gc.enable()
