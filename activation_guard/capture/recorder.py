"""Recording one forward into a golden: each layer call's outputs and, by default, its inputs.

Inputs make a golden replayable: a diverging layer can be re-run on exactly what it received when
the golden was recorded (:mod:`activation_guard.replay.replay`). They are snapshotted when the call
starts, before the layer can modify them in place, and most of them cost nothing: an input that
*is* a tensor already stored (the previous layer's output, the model's own input passed on,
an attention mask handed to every block) unchanged since (same object, same version counter) is
stored as an ``alias`` naming where its bytes are, not again.

With fingerprints (``record(fingerprint=...)``), a fingerprinted layer's outputs and its inputs
that are not aliases are stored as fingerprints alike (:class:`~activation_guard.capture.fingerprints.Fingerprinter`),
and an alias may name a fingerprint: such a call cannot be replayed (replay needs full inputs),
and the replay says so.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._core.errors import ActivationGuardError
from .._core.tensors import is_plain_tensor, version_counter
from ..store import GoldenWriter
from ..values.leaves import Leaf, LeafTransform, UnsupportedTensorError, flatten, flatten_inputs
from .fingerprints import Fingerprinter
from .hooks import Frame


class _Stored:
    """Where a stored tensor's bytes are, and the tensor as it was then (object and version)."""

    __slots__ = ("call", "fingerprint", "frame", "name", "path", "ref", "section", "version")

    def __init__(self, t: torch.Tensor, name: str, call: int, section: str, path: str, fingerprint: bool = False):
        self.ref = weakref.ref(t)
        self.version = version_counter(t)
        self.name, self.call, self.section, self.path = name, call, section, path
        self.fingerprint = fingerprint  # stored as a fingerprint: a full copy stored later is preferred
        self.frame: int | None = None  # an input of a call still running (its number may change): id of its frame


class Recorder:
    """The consumer of a recording forward: writes outputs (and inputs) as the hooks deliver
    them; ``shadow``/``floors`` (calibration) measure each output's noise floor as it is written."""

    def __init__(self, writer: GoldenWriter, *, inputs: bool, shadow: Any = None, floors: Any = None,
                 transform: LeafTransform | None = None, fingerprinter: Fingerprinter | None = None):
        """``transform``: applied to each call's input and output leaves before they are written (a
        multi-rank run's DTensors -> local values: dist_capture). ``fingerprinter``: which output
        leaves are stored as fingerprints (computed on their device)."""
        self.writer = writer
        self.transform = transform
        self.inputs = inputs
        self.fingerprinter = fingerprinter
        self.shadow = shadow
        self.floors = floors
        self.names: list[str] = []
        self._stored: dict[int, _Stored] = {}
        self._pending: dict[int, list[dict[str, Any]]] = {}  # id(frame) -> its inputs' index entries
        self._inputs_of: dict[int, list[int]] = {}  # id(frame) -> ids of the input tensors it remembered
        # a call's number is known when it returns; its inputs are referred to while it runs, under
        # the number it would have then. A module re-entered while running (recursion) returns with
        # another: the references made meanwhile are corrected when it returns
        self._assumed: dict[int, int] = {}  # id(frame) -> the call number its inputs were stored under
        self._refs: dict[int, list[dict[str, Any]]] = {}  # id(frame) -> index entries referring to its inputs
        self._calls_started: dict[str, int] = {}

    # ------------------------------------------------------------------ inputs
    def on_enter(self, frame: Frame) -> None:
        if not self.inputs or self._one_alias(frame):
            return
        # this call's index, known now: calls are numbered as they return, and a module cannot
        # return twice while it runs, except recursively (then its inputs are never aliased)
        call = self._calls_started.get(frame.name, 0)
        recursive = self._running(frame)
        try:
            leaves = flatten_inputs(frame.args, frame.kwargs)
        except UnsupportedTensorError as e:
            raise e.in_layer(frame.name, call, "an input") from None
        if self.transform is not None:  # distributed
            self.transform(frame.name, leaves)
        running: list[tuple[int, int]] = []  # (leaf index, frame id) of references to a running call's inputs
        for i, leaf in enumerate(leaves):
            if leaf.kind == "tensor" and leaf.tensor is not None:
                alias = self._alias(leaf.tensor)
                if alias is not None:
                    leaves[i] = Leaf(leaf.path, "alias", type_name=leaf.type_name, alias=alias)
                    target = self._stored[id(leaf.tensor)].frame
                    if target is not None:
                        running.append((i, target))
        where = f"the inputs of layer {frame.name or '<root>'!r} call {call}"
        try:
            stored = leaves if self.fingerprinter is None else self.fingerprinter(frame.name, leaves, where)
            entries = self.writer.write_leaves(stored, where)
        except ActivationGuardError:
            raise
        except Exception as e:
            raise ActivationGuardError(f"recording {where} failed: {e}") from e
        for i, target in running:
            self._refs.setdefault(target, []).append(entries[i])
        if not recursive:
            mine = self._inputs_of.setdefault(id(frame), [])
            self._assumed[id(frame)] = call
            for leaf, kept in zip(leaves, stored):
                if (t := leaf.passed_tensor) is not None:
                    self._remember(t, frame.name, call, "in", leaf.path, kept.kind == "fingerprint", frame=id(frame))
                    mine.append(id(t))
        self._pending[id(frame)] = entries

    def _one_alias(self, frame: Frame) -> bool:
        """Most calls of a deep model: one positional argument, the tensor a call before stored,
        unchanged since. Its alias entry is written as the general path would write it, without
        building leaves (~3 us per layer call). Nothing is remembered for an alias, so nothing
        refers to this call's inputs and its number needs no settling."""
        args = frame.args
        if frame.kwargs or type(args) is not tuple or len(args) != 1 or self.transform is not None:
            return False
        t = args[0]
        alias = self._alias(t)
        if alias is None or not is_plain_tensor(t):
            return False
        entry = self.writer.write_alias(alias, "args/0")
        target = self._stored[id(t)].frame
        if target is not None:  # the input of a call still running: its number is settled when it returns
            self._refs.setdefault(target, []).append(entry)
        self._pending[id(frame)] = [entry]
        return True

    def on_abandon(self, frame: Frame) -> None:
        """A call that raised (its caller caught the exception) is never stored: later inputs must
        not refer to its inputs, which no index entry will hold."""
        self._pending.pop(id(frame), None)
        self._assumed.pop(id(frame), None)
        self._refs.pop(id(frame), None)
        for tid in self._inputs_of.pop(id(frame), ()):
            s = self._stored.get(tid)
            if s is not None and s.section == "in" and s.frame == id(frame):
                del self._stored[tid]

    def _settle(self, frame: Frame) -> None:
        """The call returned with its number: references to its inputs made while it ran name it."""
        assumed = self._assumed.pop(id(frame), frame.call)
        refs = self._refs.pop(id(frame), ())
        for tid in self._inputs_of.pop(id(frame), ()):
            s = self._stored.get(tid)
            if s is not None and s.section == "in" and s.frame == id(frame):
                s.call, s.frame = frame.call, None
        if assumed != frame.call:
            for entry in refs:
                entry["call"] = frame.call

    def _running(self, frame: Frame) -> bool:
        f = frame.parent
        while f is not None:
            if f.module is frame.module:
                return True
            f = f.parent
        return False

    def _alias(self, t: torch.Tensor) -> dict[str, Any] | None:
        s = self._stored.get(id(t))
        if s is None or s.ref() is not t or s.version is None or s.version != version_counter(t):
            return None
        return {"name": s.name, "call": s.call, "section": s.section, "of": s.path}

    def _remember(self, t: torch.Tensor, name: str, call: int, section: str, path: str,
                  fingerprint: bool = False, *, frame: int | None = None) -> None:
        """``frame``: the inputs of a call still running (its number is settled when it returns).
        Callers pass :attr:`Leaf.passed_tensor` only: a number's or numpy value's tensor can never
        be the same value passed on."""
        old = self._stored.get(id(t))
        # a full copy beats a fingerprint (a Sequential returns its last child's output object)
        if old is None or old.ref() is not t or (old.fingerprint and not fingerprint):
            new = _Stored(t, name, call, section, path, fingerprint)
            new.frame = frame
            self._stored[id(t)] = new

    # ------------------------------------------------------------------ outputs
    def on_output(self, frame: Frame, output: Any) -> None:
        name, call = frame.name, frame.call
        self._calls_started[name] = call + 1
        try:
            leaves = flatten(output, fields=True)
            if self.transform is not None:  # distributed
                self.transform(name, leaves)
            stored = (leaves if self.fingerprinter is None  # on their device, or on the worker
                      else self.fingerprinter(name, leaves, f"layer {name or '<root>'!r} call {call} output"))
            self._settle(frame)
            self.writer.add_call(name, call, type(frame.module).__name__, stored,
                                 inputs=self._pending.pop(id(frame), None) if self.inputs else None)
            if self.shadow is not None:
                self.shadow.measure(name, call, leaves, self.floors)
        except UnsupportedTensorError as e:
            raise e.in_layer(name, call, "an output") from None
        except ActivationGuardError:
            raise
        except Exception as e:
            raise ActivationGuardError(f"recording layer {name or '<root>'!r} call {call} failed: {e}") from e
        if self.inputs:
            for leaf, kept in zip(leaves, stored):
                if (t := leaf.passed_tensor) is not None:
                    self._remember(t, name, call, "out", leaf.path, kept.kind == "fingerprint")
        if call == 0:
            self.names.append(name)
