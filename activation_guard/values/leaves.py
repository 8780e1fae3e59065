"""Flattening any layer output into addressed leaves: the values a golden stores and compares.

Every value gets a path that is *injective*: two different places in one output never share a
path, whatever their keys' types. Path components (documented in docs/format.md):

* a sequence index is its decimal digits: ``0``, ``12``;
* a ``str`` key (or dataclass field) is the key with ``%``, ``/`` and ``#`` percent-encoded, and a
  leading digit encoded too (``"0"`` is ``%30``), so no string key can look like an index;
* a named tuple's field names (layer outputs only) are a ``str`` leaf ``#fields`` beside its items;
* the empty ``str`` key is ``#str:''`` (an empty component would vanish at the top level, where
  ``{"": {"x": a}}`` and ``{"x": a}`` would share the path ``x``);
* an ``int`` key is ``#`` and its digits (``#1``, ``#-3``): ``{1: a, "1": b}`` gives ``#1`` and ``%31``;
* any other key is ``#``, its type's name, ``:`` and its ``repr`` percent-encoded
  (``#tuple:(1, 2)``, ``#Color:<Color.RED: 1>``). Two keys of one type with one ``repr`` would
  collide; that is refused with an error naming them, never merged.

Values: tensors (sparse, quantized and nested ones reduced to what they hold; a wrapper subclass
such as ``TwoTensor`` to its class under ``#type``, the tensors its ``__tensor_flatten__`` names
and its metadata under ``#ctx``), numpy arrays and numpy scalars (stored by value with their
dtype, like tensors), Python numbers (0-d tensors, one shared per value: :mod:`.scalars`),
strings, ``None``, and as text torch dtypes, devices, layouts and memory formats (their ``repr``),
enum members (class, name and value) and ``bytes`` (hex, or SHA-256 beyond 4 KiB). A container
reached a second time (a repeated reference, or a cycle such as ``d["self"] = d``) becomes a
``ref`` leaf naming the path of its first occurrence and is never walked again. Anything else (a
KV-cache object, a generator) is an ``object`` leaf recorded by type name only; reports count
those, so "OK" never hides a value that was not compared. Path components are spelled by
:mod:`.paths`; the way back (values into structures) is :mod:`.rebuild`; the tensor predicates the
recording path shares are in :mod:`.._core.tensors`.

A little over the ~400 lines we aim for: the walker covers every kind of value above in one pass.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .._core.errors import ActivationGuardError
from .._core.kinds import LeafKind
from .._core.tensors import is_plain_tensor, wrapped
from .paths import (
    FIELDS,
    SUBCLASS_CTX,
    SUBCLASS_TYPE,
    encode_key,
    encode_str_key,
    enum_text,
    first_duplicate,
    join_path,
    legacy_key,
)
from .scalars import number_tensor

if TYPE_CHECKING:
    from ..fingerprints.fingerprint import Fingerprint
    from ..fingerprints.worker import PendingFingerprint

MAX_DEPTH = 32
MAX_BYTES_INLINE = 4096  # a longer bytes value is stored as its SHA-256
# values compared by their repr (stored as ``str`` leaves with the type's name): a layer returning
# ``torch.float16`` where it returned ``torch.float32`` has changed
_BY_REPR = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)
EMPTY_PREFIX = "empty "  # type names of empty containers: a structure marker, not a value


# a ``deque`` is walked like a list, a ``SimpleNamespace`` like a dict of its attributes (by type
# only, their values would go uncompared). Exactly those types: a subclass may have an __init__
# that cannot rebuild it, and a namespace with a non-str attribute cannot be rebuilt either. Goldens
# from before store them as ``object`` leaves: compared by type, with a note (comparator).
WALKED_SINCE = ("deque", "SimpleNamespace")  # once recorded by type only


def walked_sequence(obj: Any) -> bool:
    """A tuple, a list (their subclasses too: named tuples) or exactly a ``deque``."""
    return isinstance(obj, (tuple, list)) or type(obj) is deque


def plain_namespace(obj: Any) -> bool:
    """A ``types.SimpleNamespace`` (not a subclass) whose attribute names are all strings."""
    return type(obj) is SimpleNamespace and all(type(k) is str for k in vars(obj))


def _type_name(obj: Any) -> str:
    return "SimpleNamespace" if isinstance(obj, NamespaceView) else type(obj).__name__


class NamespaceView(Mapping[str, Any]):
    """A ``types.SimpleNamespace`` walked as the mapping of its attributes (its type name kept)."""

    __slots__ = ("ns",)

    def __init__(self, ns: SimpleNamespace):
        self.ns = ns

    def __getitem__(self, k: str) -> Any:
        return vars(self.ns)[k]

    def __iter__(self) -> Iterator[str]:
        return iter(vars(self.ns))

    def __len__(self) -> int:
        return len(vars(self.ns))




@dataclass
class Leaf:
    """One addressed value inside a layer's output (or inputs).

    ``kind``: ``tensor`` (tensors, numpy arrays and Python numbers, as tensors), ``none``, ``str``
    (``value`` holds it), ``ref`` (``value`` is the path of the container's first occurrence),
    ``object`` (anything else: recorded by type name only, never iterated) or, for recorded inputs,
    ``alias`` (the very tensor another call's output or input already stored). ``type_name`` is the
    Python type a value had (``Tensor``, ``numpy.ndarray``, ``float``...). ``legacy_path`` is the
    path golden format 1 gave this leaf, when it differs (non-string keys, digit-like strings).
    A ``fingerprint`` leaf stands for a tensor by its ``fingerprint`` (being recorded, or read back
    from a recording for ``diff``).
    """

    path: str
    kind: LeafKind
    tensor: torch.Tensor | None = None
    type_name: str = "Tensor"
    value: str | None = None
    legacy_path: str | None = None
    # distributed: how the tensor was distributed over ranks (a distributed.LocalShard or
    # ShardLayout), set by dist_capture.RankCapture in a multi-rank run; None everywhere else
    dist: object | None = None
    alias: dict[str, Any] | None = None  # kind "alias": where the identical stored value is
    fingerprint: Fingerprint | PendingFingerprint | None = None  # pending: being computed while recording

    @property
    def passed_tensor(self) -> torch.Tensor | None:
        """The tensor itself when the model passed one here (type ``Tensor``), else None. Checks of
        identity or storage (input aliases, shared memory) take only these: a Python number's
        tensor is one shared per value (:mod:`.scalars`) and a numpy value's a fresh copy."""
        return self.tensor if self.kind == "tensor" and self.type_name == "Tensor" else None

    @property
    def type_only(self) -> bool:
        """Compared by type name only: no value of it is checked."""
        return self.kind == "object" and not self.type_name.startswith(EMPTY_PREFIX)


# rewrites one layer call's leaves in place before they are stored or compared: (layer name, leaves)
LeafTransform = Callable[[str, list[Leaf]], None]


class PathCollisionError(ValueError):
    """Two keys of one mapping encode to one path (same type, same repr)."""


def _under(path: str, legacy: str | None, comp: str) -> tuple[str, str | None]:
    """A child's path and its format-1 path, for a component both formats spell alike."""
    return join_path(path, comp), None if legacy is None else join_path(legacy, comp)


class _Walker:
    """One flatten: the leaves so far, and the containers seen (by identity) with their paths."""

    __slots__ = ("fields", "out", "seen")

    def __init__(self, fields: bool = False) -> None:
        self.out: list[Leaf] = []
        self.seen: dict[int, str] = {}
        self.fields = fields

    def leaf(self, path: str, legacy: str | None, kind: LeafKind, **kw: Any) -> None:
        self.out.append(Leaf(path, kind, legacy_path=legacy if legacy != path else None, **kw))

    def walk(self, obj: Any, path: str, legacy: str | None, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, path, legacy, depth)
            return
        if obj is None:
            self.leaf(path, legacy, "none", type_name="None")
            return
        if isinstance(obj, (bool, int, float, complex)):
            self.number(obj, path, legacy)
            return
        if isinstance(obj, str):
            self.leaf(path, legacy, "str", type_name="str", value=obj)
            return
        if isinstance(obj, (np.ndarray, np.generic)):
            self.numpy(obj, path, legacy)
            return
        if isinstance(obj, _BY_REPR):
            value = enum_text(obj) if isinstance(obj, enum.Enum) else repr(obj)
            self.leaf(path, legacy, "str", type_name=type(obj).__name__, value=value)
            return
        if isinstance(obj, (bytes, bytearray)):
            value = obj.hex() if len(obj) <= MAX_BYTES_INLINE else "sha256:" + hashlib.sha256(obj).hexdigest()
            self.leaf(path, legacy, "str", type_name=type(obj).__name__, value=value)
            return
        if depth >= MAX_DEPTH:
            self.leaf(path, legacy, "object", type_name=type(obj).__name__)
            return
        if plain_namespace(obj):  # its attributes, like a dict's str keys
            obj = NamespaceView(obj)
        is_map = isinstance(obj, Mapping)
        is_seq = walked_sequence(obj)
        is_dc = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        if not (is_map or is_seq or is_dc):
            self.leaf(path, legacy, "object", type_name=type(obj).__name__)
            return
        if (is_map or is_seq) and not obj:
            self.leaf(path, legacy, "object", type_name=f"{EMPTY_PREFIX}{_type_name(obj)}")
            return
        key = id(obj.ns) if isinstance(obj, NamespaceView) else id(obj)
        first = self.seen.get(key)
        if first is not None:  # a repeated reference or a cycle: point at the first occurrence
            self.leaf(path, legacy, "ref", type_name=_type_name(obj), value=first)
            return
        self.seen[key] = path
        if is_map:
            self.mapping(obj, path, legacy, depth)
        elif is_seq:
            for i, v in enumerate(obj):
                k = str(i)
                self.walk(v, *_under(path, legacy, k), depth + 1)
            names_of = getattr(obj, "_fields", None) if self.fields and isinstance(obj, tuple) else None
            if isinstance(names_of, tuple):
                # a named tuple's field names: which value ``out.logits`` is (values keep their indices)
                names = ",".join(str(f) for f in names_of)
                self.leaf(*_under(path, legacy, FIELDS), "str", type_name="namedtuple", value=names)
        else:
            for f in dataclasses.fields(obj):
                k = encode_str_key(f.name)
                lk = None if legacy is None else join_path(legacy, legacy_key(f.name))
                self.walk(getattr(obj, f.name, None), join_path(path, k), lk, depth + 1)

    def mapping(self, obj: Mapping[Any, Any], path: str, legacy: str | None, depth: int) -> None:
        used: dict[str, Any] = {}
        for k, v in obj.items():
            comp = encode_key(k)
            if comp in used:
                raise PathCollisionError(
                    f"output keys {used[comp]!r} and {k!r} ({type(k).__name__}) at {path or 'the top level'!r} "
                    f"both encode to the path component {comp!r}; use keys whose repr differs")
            used[comp] = k
            self.walk(v, join_path(path, comp), None if legacy is None else join_path(legacy, legacy_key(k)), depth + 1)

    def number(self, obj: bool | int | float | complex, path: str, legacy: str | None) -> None:
        if isinstance(obj, bool):
            self.leaf(path, legacy, "tensor", tensor=number_tensor(obj, torch.bool), type_name="bool")
        elif isinstance(obj, int):
            if -(2**63) <= obj < 2**63:
                self.leaf(path, legacy, "tensor", tensor=number_tensor(obj, torch.int64), type_name="int")
            else:
                self.leaf(path, legacy, "str", type_name="int", value=str(obj))
        elif isinstance(obj, float):
            self.leaf(path, legacy, "tensor", tensor=number_tensor(obj, torch.float64), type_name="float")
        else:
            self.leaf(path, legacy, "tensor", tensor=number_tensor(obj, torch.complex128), type_name="complex")

    def numpy(self, obj: np.ndarray | np.generic, path: str, legacy: str | None) -> None:
        name = f"numpy.{type(obj).__name__}"
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc" or arr.dtype.itemsize > 16:
            # strings, objects, datetimes, structured: no tensor dtype holds them
            self.leaf(path, legacy, "object", type_name=f"{name}[{arr.dtype.str}]")
            return
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        try:
            t = torch.from_numpy(np.array(arr, copy=True, order="C"))  # a snapshot the model cannot change
        except TypeError:  # a numpy dtype torch has no counterpart for (e.g. float128)
            self.leaf(path, legacy, "object", type_name=f"{name}[{arr.dtype.str}]")
            return
        self.leaf(path, legacy, "tensor", tensor=t, type_name=name)

    def tensor(self, t: torch.Tensor, path: str, legacy: str | None, depth: int) -> None:
        """Plain strided tensors are leaves; other tensor kinds are reduced to what they hold."""
        if getattr(t, "is_nested", False):
            self.walk(list(t.unbind()), path, legacy, depth + 1)
            return
        if wrapped(t):
            raise UnsupportedTensorError(
                "a tensor inside a torch.func transform (vmap, grad, jacrev...): a hook sees a wrapper, not "
                "the values; exclude the layers that run inside the transform (exclude=[...]) or apply the "
                "transform outside the model")
        if type(t) not in _PLAIN_TYPES and _own_dispatch(type(t)) and not type(t).__module__.startswith(
                "torch.distributed"):  # DTensors are turned into local values by dist_capture
            inner = getattr(t, "__tensor_flatten__", None)
            if inner is None:
                raise UnsupportedTensorError(
                    f"a {type(t).__name__} (a tensor subclass with its own __torch_dispatch__ and no "
                    "__tensor_flatten__) cannot be read as values; exclude the layer (exclude=[...]) or "
                    "return plain tensors")
            if depth >= MAX_DEPTH:
                raise UnsupportedTensorError(
                    f"a {type(t).__name__} nested more than {MAX_DEPTH} levels deep (does its "
                    "__tensor_flatten__ context hold itself?); exclude the layer (exclude=[...])")
            # a wrapper subclass (TwoTensor, a float8 training tensor): its class under ``#type``, the
            # tensors it holds by name, and its metadata (a scale, a block size: the values depend on
            # it) under ``#ctx``
            self.leaf(*_under(path, legacy, SUBCLASS_TYPE), "str", type_name="type", value=type(t).__qualname__)
            attrs, ctx = inner()
            for attr in attrs:
                self.walk(getattr(t, attr), *_under(path, legacy, encode_str_key(attr)), depth + 1)
            if ctx is not None:
                self.walk(ctx, *_under(path, legacy, SUBCLASS_CTX), depth + 1)
            return
        if t.device.type == "meta":
            self.leaf(path, legacy, "object", type_name=f"meta Tensor{list(t.shape)}")
            return
        if t.is_quantized:
            t = t.dequantize()
        elif t.layout != torch.strided:
            t = t.to_dense()
        self.leaf(path, legacy, "tensor", tensor=t, type_name="Tensor")


_PLAIN_TYPES = tuple(c for c in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if c is not None)
_NO_DISPATCH = getattr(torch.Tensor.__torch_dispatch__, "__func__", torch.Tensor.__torch_dispatch__)


def is_wrapper(t: torch.Tensor) -> bool:
    """A wrapper tensor subclass the walker flattens into its inner tensors (not a DTensor)."""
    cls = type(t)
    return (cls not in _PLAIN_TYPES and _own_dispatch(cls) and hasattr(cls, "__tensor_flatten__")
            and not cls.__module__.startswith("torch.distributed"))


def wrapper_type(obj: Any) -> str | None:
    """The class name of the first wrapper tensor subclass in ``obj`` (gradients cannot be read
    through one: its inner tensors are not what autograd differentiates), or None."""
    if isinstance(obj, torch.Tensor) and not is_wrapper(obj):
        return None
    for leaf in flatten(obj):  # finds them inside dataclasses and mappings too
        if leaf.type_name == "type" and leaf.path.rsplit("/", 1)[-1] == SUBCLASS_TYPE:
            return leaf.value
    return None


def _own_dispatch(cls: type) -> bool:
    f = getattr(cls, "__torch_dispatch__", None)
    return getattr(f, "__func__", f) is not _NO_DISPATCH


class UnsupportedTensorError(ActivationGuardError, TypeError):
    """A tensor whose values a hook cannot read (inside torch.vmap, an opaque dispatch subclass)."""

    def in_layer(self, name: str, call: int | None, what: str) -> UnsupportedTensorError:
        """The same error, naming the layer call and which of its values (``an input``) it is."""
        where = f"layer {name or '<root>'!r}" + ("" if call is None else f" call {call}")
        return UnsupportedTensorError(f"{where}: {what} is {self}")


def flatten_inputs(args: Any, kwargs: Any) -> list[Leaf]:
    """A call's arguments as leaves: ``args/0``, ``args/1``, ``kwargs/<name>``..."""
    if not kwargs and all(is_plain_tensor(a) for a in args):
        return [Leaf(f"args/{i}", "tensor", tensor=a) for i, a in enumerate(args)]
    return flatten({"args": list(args), "kwargs": kwargs})


def flatten(obj: Any, prefix: str = "", *, fields: bool = False) -> list[Leaf]:
    """Flatten an output into leaves with injective slash-separated paths (module docstring).

    Tuples/lists are addressed by index, mappings (including Hugging Face ``ModelOutput``) and
    dataclasses by key/field name. A bare tensor output has the empty path. ``fields``: a named
    tuple also gets a ``str`` leaf ``#fields`` holding its field names (layer outputs, as stored
    and compared; compared only where both sides have it, see the comparator).
    """
    if is_plain_tensor(obj):
        return [Leaf(prefix, "tensor", tensor=obj)]
    w = _Walker(fields)
    w.walk(obj, prefix, prefix, 0)
    dup = None if len(w.out) < 2 else first_duplicate(leaf.path for leaf in w.out)
    if dup is not None:  # the encoding is injective, so this is a bug here: refuse rather than compare one of two
        raise PathCollisionError(f"two values in one output share the path {dup!r}; please report this")
    return w.out


_MISSING = object()


def value_at(obj: Any, path: str) -> Any:
    """The value at leaf ``path`` inside ``obj`` (containers walked as :func:`flatten` walks them),
    or None when there is none: the comparator's check that a container an older golden holds by
    type only is still that container."""
    for comp in path.split("/") if path else ():
        if plain_namespace(obj):
            obj = NamespaceView(obj)
        if walked_sequence(obj) and comp.isdigit():
            i = int(comp)
            obj = obj[i] if i < len(obj) else _MISSING
        elif isinstance(obj, Mapping):
            obj = next((v for k, v in obj.items() if encode_key(k) == comp), _MISSING)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            obj = next((getattr(obj, f.name, None) for f in dataclasses.fields(obj)
                        if encode_str_key(f.name) == comp), _MISSING)
        else:
            return None
        if obj is _MISSING:
            return None
    return obj
