"""Writing gradients into a golden, and where a golden keeps their float64 noise floors.

:class:`GradRecorder` is the :class:`~activation_guard.gradients.hooks.GradSink` of a recording: each
gradient's bytes are written the moment the backward hands it over (the snapshot; nothing is
kept), and the index entries are put in backward execution order once the backward is done.
The same sink writes the float64 shadow's gradients (:mod:`activation_guard.calibration.shadow`), which the
calibrated rule reads as the gradients' noise floors (:mod:`activation_guard.comparison.gradients`).

Floors of gradients live in their own table (meta ``backward.calibration``, the layout of the
forward's ``calibration``), keyed by layer, call and ``"<output|input|param>:<leaf path>"``.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .._core.dtypes import dtype_name, tensor_bytes
from .._core.errors import ActivationGuardError, GoldenFormatError, UncalibratedGoldenError
from ..store import GoldenWriter
from ..store.floors import CALIBRATED_DTYPES, FloorTable, NoiseFloor
from ..values.leaves import Leaf, UnsupportedTensorError, wrapper_type
from .hooks import Event
from .loss import META_KEY

CALIBRATION_KEY = "calibration"  # under meta[META_KEY]: the gradients' noise floors


def floor_path(grad: str, path: str) -> str:
    """The floor table's path of one gradient leaf."""
    return f"{grad}:{path}"


def describe_leaf(ev: Event, path: str) -> str:
    """How messages name one gradient: 'the gradient w.r.t. input 'args/0' of layer 'fc' call 0'."""
    who = f"layer {ev.name or '<root>'!r}"
    if ev.grad == "param":
        return f"the gradient of parameter {path!r} of {who}"
    what = "the output" if ev.grad == "output" and not path else f"{ev.grad} {path!r}"
    return f"the gradient w.r.t. {what} of {who} call {ev.call}"


# Gradients up to this size are packed (outputs: up to SMALL_LEAF_BYTES). A backward writes many
# mid-sized tensors (parameter gradients of 100 KB-1 MB) at once, and one HDF5 dataset costs ~0.3 ms
# to create: a quarter of what recording a small GPT-2's gradients cost. Packs stay <= PACK_BYTES + this.
PACK_UP_TO = 1 << 20
RECENT_ITEMS = 64  # copies of stored gradients kept to recognise the same values delivered again
RECENT_BYTES = 64 << 20


class _Recent:
    """Gradients stored lately, by value. The same values reach several records (a parent's
    output gradient is its last child's; a layer's input gradient is what its producer receives
    as output gradient, often as the very tensor, sometimes as the engine's own sum of the same
    contributions): the later one is stored as an alias of the first when its bytes are exactly
    equal (same dtype, shape and CRC-32, then a byte-for-byte comparison with a copy kept here;
    NaN payloads included). Bounded: the oldest copies are dropped beyond ``RECENT_ITEMS`` /
    ``RECENT_BYTES``."""

    def __init__(self) -> None:
        self.items: OrderedDict[tuple[Any, ...], tuple[bytes, dict[str, Any]]] = OrderedDict()
        self.nbytes = 0

    def find(self, t: torch.Tensor) -> tuple[tuple[Any, ...], bytes, dict[str, Any] | None]:
        if wrapper_type(t) is not None:
            raise UnsupportedTensorError(f"a gradient is a {type(t).__name__} (a wrapper tensor subclass, e.g. of a "
                                         f"parameter of that type): it cannot be stored as values; compare the "
                                         f"forward only")
        raw = tensor_bytes(t).tobytes()
        key = (dtype_name(t), tuple(t.shape), zlib.crc32(raw) if raw else 0)
        hit = self.items.get(key)
        if hit is not None and hit[0] == raw:
            self.items.move_to_end(key)
            return key, raw, hit[1]
        return key, raw, None

    def add(self, key: tuple[Any, ...], raw: bytes, alias: dict[str, Any]) -> None:
        if key in self.items:
            self.nbytes -= len(self.items[key][0])
        self.items[key] = (raw, alias)
        self.items.move_to_end(key)
        self.nbytes += len(raw)
        while len(self.items) > 1 and (len(self.items) > RECENT_ITEMS or self.nbytes > RECENT_BYTES):
            _, (old, _) = self.items.popitem(last=False)
            self.nbytes -= len(old)

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0


class FloorSource(Protocol):
    """A float64 run's gradients (:class:`~activation_guard.calibration.shadow.ShadowRun` with a backward)."""

    def grad_floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None: ...


class GradRecorder:
    """Writes each gradient as it arrives; ``finish`` lists them in backward order. With
    ``shadow`` (a float64 run that has its gradients), each floating gradient's noise floor goes
    into ``floors``."""

    def __init__(self, writer: GoldenWriter, *, shadow: FloorSource | None = None, floors: FloorTable | None = None):
        self.writer = writer
        self.shadow = shadow
        self.floors = floors
        self.entries: dict[int, dict[str, dict[str, Any]]] = {}
        self.count = 0
        self.aliases = 0
        self._recent = _Recent()

    def leaf(self, event: Event, path: str, grad: torch.Tensor | None) -> None:
        where = describe_leaf(event, path)
        key, raw, same = ((), b"", None) if grad is None else self._recent.find(grad)
        if grad is None:
            leaf = Leaf(path, "none", type_name="None")
        elif same is not None:
            leaf = Leaf(path, "alias", alias=same)
            self.aliases += 1
        else:
            leaf = Leaf(path, "tensor", tensor=grad)
        try:
            entry = self.writer.write_leaves([leaf], where, pack_up_to=PACK_UP_TO)[0]
        except ActivationGuardError:
            raise
        except Exception as e:
            raise ActivationGuardError(f"recording {where} failed: {e}") from e
        self.entries.setdefault(id(event), {})[path] = entry
        if grad is not None and same is None and entry.get("kind") == "tensor":
            self._recent.add(key, raw, {"name": event.name, "call": event.call, "section": f"grad-{event.grad}",
                                        "of": path})
        if self.shadow is not None and self.floors is not None and grad is not None \
                and dtype_name(grad) in CALIBRATED_DTYPES:
            fp = floor_path(event.grad, path)
            self.floors.add(event.name, event.call, fp, self.shadow.grad_floor(event.name, event.call, fp, grad))

    def finish(self, events: list[Event]) -> None:
        for ev in events:
            got = self.entries.get(id(ev), {})
            self.writer.add_backward(ev.grad, ev.name, ev.call, ev.type_name, [got[p] for p in ev.paths])
        self.count = len(events)
        self.entries.clear()
        self._recent.clear()


def grad_floors(meta: Mapping[str, Any], path: str) -> FloorTable:
    """The gradients' noise floors a calibrated golden holds; a clear error when it has none."""
    rec = meta.get(META_KEY)
    cal = rec.get(CALIBRATION_KEY) if isinstance(rec, Mapping) else None
    if cal is None:
        raise UncalibratedGoldenError(
            path, 'has gradients but no noise floors for them, which tolerance="calibrated" needs',
            fix="re-record the golden with calibration (record options calibrate=True, backward=...)")
    if not isinstance(cal, Mapping):
        raise GoldenFormatError(path, f"has a malformed {META_KEY}.{CALIBRATION_KEY} record in its meta",
                                fix="re-record it with calibrate=True")
    return FloorTable.from_meta({"calibration": cal}, path)
