"""Recording with fingerprints: which outputs are stored as fingerprints, computed where they live.

``record(..., fingerprint=True)`` (or layer globs) replaces, in each selected layer's flattened
output, every tensor leaf worth fingerprinting (floating or complex, and larger than its
fingerprint: :func:`should_fingerprint`) by a ``fingerprint`` leaf. Everything else stays exact:
integer and bool tensors, small tensors, strings, ``None``, objects, and every leaf of layers the
globs do not name. The fingerprint is computed on the tensor's own device
(:func:`compute_fingerprint`); only the fingerprint crosses to the host.

The golden's meta says what was asked (``"fingerprint": {"layers": true | [globs], ...}``); the
store adds the parameters (:mod:`activation_guard.store.fingerprints`).
"""

from __future__ import annotations

import weakref
from typing import Any, Union

import torch

from .._core import native, switches
from .._core.tensors import is_plain_tensor, version_counter
from ..fingerprints.fingerprint import Fingerprint, FingerprintParams, should_fingerprint
from ..fingerprints.worker import ENV as WORKER_ENV
from ..fingerprints.worker import FingerprintWorker, PendingFingerprint, inline_or_queued, wanted
from ..options.selection import match_any
from ..options.spec import RecordSpec
from ..store.fingerprints import META_KEY
from ..values.leaves import Leaf

Taken = Union[Fingerprint, PendingFingerprint]  # (a runtime alias: Python 3.9 has no X | Y there)


class Fingerprinter:
    """Turns a layer call's leaves into the leaves to store, per the spec's ``fingerprint``."""

    def __init__(self, layers: bool | tuple[str, ...], params: FingerprintParams, *, worker: bool | None = None):
        """``worker``: compute CPU fingerprints on a worker thread beside the forward
        (:mod:`..fingerprints.worker`); ``None``: as :func:`~..fingerprints.worker.wanted` says.
        Call :meth:`close`."""
        self.layers = layers
        self.params = params
        switches.read(native.ENV)  # a bad value raises here, on the caller's thread, not on the worker's
        built = native.start()  # the compiler runs while the forward gets going
        use = wanted() if worker is None else worker
        # no free core, but a build under way: a worker takes the leaves until it is done, so the
        # forward goes on beside the compiler instead of waiting for it at its first leaf
        interim = not use and not built and worker is None and switches.read(WORKER_ENV) is None
        self.worker = FingerprintWorker() if use else FingerprintWorker(until_built=True) if interim else None
        self.fingerprinted = 0  # leaves stored as fingerprints
        self.matched: set[str] = set()  # globs that named at least one layer
        # id -> (the tensor, its version, where its values are, and its fingerprint): see _taken
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[Any, ...], Taken]] = {}
        self.reused = 0  # leaves whose fingerprint was taken once already in this recording

    @classmethod
    def for_spec(cls, spec: RecordSpec) -> Fingerprinter | None:
        """None when the spec keeps every output exact."""
        if spec.fingerprint is False:
            return None
        return cls(spec.fingerprint, spec.fingerprint_params)

    def wants(self, name: str) -> bool:
        if self.layers is True:
            return True
        assert not isinstance(self.layers, bool)
        hit = [p for p in self.layers if match_any(name, [p])]
        self.matched.update(hit)
        return bool(hit)

    def __call__(self, name: str, leaves: list[Leaf], where: str = "") -> list[Leaf]:
        """``where``: the call and section, for errors (``"layer 'fc' call 0 output"``)."""
        if not self.wants(name):
            return leaves
        out = []
        for leaf in leaves:
            t = leaf.tensor
            if leaf.kind == "tensor" and t is not None and should_fingerprint(t, self.params):
                fp = self._taken(t)
                if fp is None:
                    fp = inline_or_queued(self.worker, t, self.params, f"{where or repr(name)} path {leaf.path!r}")
                    self._remember(t, fp)
                self.fingerprinted += 1
                out.append(Leaf(leaf.path, "fingerprint", type_name=leaf.type_name, legacy_path=leaf.legacy_path,
                                fingerprint=fp))
            else:
                out.append(leaf)
        return out

    def _taken(self, t: torch.Tensor) -> Taken | None:
        """The fingerprint already taken of this very tensor, unchanged since (same object, same
        version counter, same memory and layout), or None. A layer that hands its child's output
        on (dropout in eval mode, a block returning its last projection) stores the same values
        again: on GPT-2 small 49 of 174 fingerprinted leaves. Its blob is stored again, byte for
        byte, without a second copy and kernel. The version counter is the one the recorder's input
        aliases trust: a write that bypasses it (``.data``, numpy) between the two hooks leaves the
        second leaf with the first one's fingerprint, which a later compare reports as a change."""
        hit = self._seen.get(id(t))
        if hit is None:
            return None
        ref, version, where, fp = hit
        if ref() is not t or version_counter(t) != version or _where(t) != where:
            return None
        self.reused += 1
        return fp

    def _remember(self, t: torch.Tensor, fp: Taken) -> None:
        version = version_counter(t)
        if version is not None and is_plain_tensor(t):  # (weak references and a counter to trust)
            self._seen[id(t)] = (weakref.ref(t), version, _where(t), fp)

    def close(self) -> None:
        """Stop the worker thread, if one was started (the recording is committed or aborted)."""
        self._seen.clear()
        if self.worker is not None:
            self.worker.close()

    def meta(self) -> dict[str, Any]:
        """What was asked, for the golden's meta (the store adds the parameters it used)."""
        return {"layers": list(self.layers) if isinstance(self.layers, tuple) else True}

    def unmatched(self) -> list[str]:
        """Globs that named no recorded layer (a typo would otherwise keep everything full)."""
        if isinstance(self.layers, bool):
            return []
        return [p for p in self.layers if p not in self.matched]


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's values are, and in what layout: the same object may be resized in place."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(), t.device)


def meta_entry(fingerprinter: Fingerprinter | None) -> dict[str, Any]:
    """``{META_KEY: ...}`` to merge into a golden's meta, or nothing."""
    return {} if fingerprinter is None else {META_KEY: fingerprinter.meta()}

