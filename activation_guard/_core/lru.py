"""A least-recently-used cache within a byte budget, shared by threads: the fingerprint kernel's
hash tables (``sketch.HASHES``) and its prepared plans (``fingerprint_plan.PLANS``).

Each cache has one lock. A fork while another thread holds it would leave the child's copy held
forever (18 of 200 forked children hung), so every cache gets a fresh lock in the
child.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


_EVERY: weakref.WeakSet[ByteLRU[object]] = weakref.WeakSet()  # for the fork handler


class ByteLRU(Generic[V]):
    """Values with their sizes; the least recently used go first once ``budget`` bytes are passed,
    and a value larger than the whole budget is not kept."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self.lock = threading.Lock()
        self.items: OrderedDict[Hashable, V] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        _EVERY.add(self)  # type: ignore[arg-type]

    def get(self, key: Hashable) -> V | None:
        with self.lock:
            hit = self.items.get(key)
            if hit is not None:
                self.items.move_to_end(key)
            return hit

    def put(self, key: Hashable, value: V, size: int) -> None:
        with self.lock:
            if size > self.budget or key in self.items:
                return
            self.items[key] = value
            self._sizes[key] = size
            self.used += size
            while self.used > self.budget:
                old, _ = self.items.popitem(last=False)
                self.used -= self._sizes.pop(old)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self._sizes.clear()
            self.used = 0


def _after_fork_in_child() -> None:
    for cache in list(_EVERY):
        cache.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
