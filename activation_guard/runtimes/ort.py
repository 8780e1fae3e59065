"""An ONNX model run in ONNX Runtime as a source of live values, module call by module call.

``torch.onnx.export(..., dynamo=True)`` names each ONNX node's module calls in its metadata:
``pkg.torch.onnx.name_scopes`` is a Python literal list of the module paths it ran inside, root
first, then the FX node's own name (``['', 'h.0', 'h.0.attn', 'view_3']``), and
``pkg.torch.onnx.class_hierarchy`` their classes. :class:`OnnxGraph` reads them: a node with no
metadata (made by a graph pass) belongs to the module calls all its neighbours share
(:func:`~activation_guard.values.scopes.common_prefix`), and each module call's outputs are the
values produced inside its scope and read outside it, or returned. ONNX Runtime returns a value
only when it is a graph output, so :class:`OrtSource` adds every such value as one, runs the
model once, and yields each call with its values, named by the eager path. Which value is which
eager output is read from the golden's leaves by shape and dtype, never guessed
(:func:`~activation_guard.values.scopes.assign_outputs`).

The metadata names a module path, not a call: a module called several times gets one run of nodes
per call, matched to the golden's calls in order only when the counts agree. A golden module call
with no node (an eval-mode dropout removed, a position table folded into a constant, a BatchNorm
merged into the Conv before it) or whose values cannot be told apart is listed in :attr:`skipped`
with the reason; never a silent gap. The model's final outputs are also taken from a second,
unmarked run with every ONNX Runtime optimization on: the deployed computation itself, since
marking values as outputs changes what the optimizer may fuse.

``onnx`` and ``onnxruntime`` are imported only here, lazily: without them :func:`require_onnx`
names the extra that installs them. The graph reading (:class:`OnnxGraph`), the sessions, the
source and a call's re-run alone stay in this one module: all four work on the same parsed
scopes and value names, and nothing outside ONNX Runtime uses them.
"""

from __future__ import annotations

import ast
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch

from .._core.errors import UnsupportedModelError
from ..store.format import CallEntry, LeafEntry
from ..values.calls import LiveCall
from ..values.leaves import Leaf, flatten
from ..values.scopes import (
    TENSOR_KINDS,
    Signature,
    Skipped,
    assign_outputs,
    book_outputs,
    common_prefix,
    output_name,
)

EXTRA = "activation_guard[onnx]"
SCOPES_KEY = "pkg.torch.onnx.name_scopes"
CLASSES_KEY = "pkg.torch.onnx.class_hierarchy"

# "off": ONNX Runtime's graph optimizations disabled, every value as the exporter wrote it (a
# faithful per-module map); "basic": constant folding and redundant-node removal; "default": every
# optimization (ORT's own default), compared where the marked values survive
Optimization = Literal["off", "basic", "default"]
OPTIMIZATIONS: tuple[Optimization, ...] = get_args(Optimization)
PROVIDER = "CPUExecutionProvider"


def require_onnx() -> tuple[Any, Any]:
    """The ``onnx`` and ``onnxruntime`` modules, or one error naming the extra that installs them."""
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise UnsupportedModelError(f"comparing an ONNX model needs the optional extra: pip install '{EXTRA}' "
                                    f"(onnx, onnxruntime, onnxscript); {e}") from None
    return onnx, onnxruntime


def load_model(model: Any) -> tuple[Any, str]:
    """An ``.onnx`` path, an ``onnx.ModelProto`` or a ``torch.onnx.ONNXProgram`` as a ModelProto,
    and what it is, for notes and errors. A given ModelProto is not copied (a large model's weights
    are not held twice) and is left as it was given."""
    onnx, _ = require_onnx()
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise UnsupportedModelError(f"ONNX model {path!r} is not a file")
        try:
            proto = onnx.load(path)
        except Exception as e:
            raise UnsupportedModelError(f"ONNX model {path!r} could not be read (onnx.load: {type(e).__name__}: "
                                        f"{e})") from e
        return proto, f"ONNX model {os.path.basename(path)}"
    if isinstance(model, onnx.ModelProto):
        out, label = model, "ONNX model"
    elif isinstance(getattr(model, "model_proto", None), onnx.ModelProto):  # torch.onnx.ONNXProgram
        out, label = model.model_proto, "ONNX program"
    else:
        raise UnsupportedModelError(f"{type(model).__name__}: an ONNX model is an .onnx path, an onnx.ModelProto or "
                                    f"a torch.onnx.ONNXProgram (torch.onnx.export(model, args, dynamo=True))")
    return out, label


def optimization_level(ort: Any, optimization: str) -> Any:
    level = ort.GraphOptimizationLevel
    return {"off": level.ORT_DISABLE_ALL, "basic": level.ORT_ENABLE_BASIC, "default": level.ORT_ENABLE_ALL}[
        optimization]


def session(model: Any, optimization: str, threads: int = 0) -> Any:
    """An ONNX Runtime CPU session over a ModelProto (or its bytes) at an optimization level, with
    ``threads`` intra-op threads (0: ONNX Runtime's default, one per core)."""
    _, ort = require_onnx()
    so = ort.SessionOptions()
    so.graph_optimization_level = optimization_level(ort, optimization)
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    try:
        data = model if isinstance(model, bytes) else model.SerializeToString()
        return ort.InferenceSession(data, so, providers=[PROVIDER])
    except Exception as e:
        raise UnsupportedModelError(f"ONNX Runtime cannot load the model: {type(e).__name__}: {e}") from e


def split_cores() -> tuple[int, int]:
    """Intra-op threads for the marked session and the unmarked one, which build and run at the
    same time: the cores this process may use, split between them (at least one each), so that
    neither's thread pool waits for cores the other holds (on two cores, two default pools made
    a small model's sessions 2x slower than one thread each)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    final = max(1, n // 2)
    return max(1, n - final), final


class FinalRun:
    """The model as deployed: a session with every optimization on and no value marked, built in a
    second thread from the moment the model is read (ONNX Runtime releases the GIL while it builds
    and runs a session, so this overlaps the scope analysis, the golden's opening and the marked
    run), then run on the feeds once they are known (:meth:`start`); :meth:`outputs` waits for it.
    The model is serialized once, here: :meth:`take_data` hands the bytes to the marked session
    (:meth:`OrtSource.run` appends its added outputs to them)."""

    def __init__(self, proto: Any):
        self.names = [o.name for o in proto.graph.output]
        self._proto = proto
        self.data = proto.SerializeToString()
        self._model = self.data
        self._threads = split_cores()[1]
        self._feeds: Mapping[str, np.ndarray] | None = None
        self._go = threading.Event()
        self._out: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, daemon=True, name="activation_guard-ort-final")
        self._thread.start()

    def _work(self) -> None:
        try:
            sess = session(self._model, "default", self._threads)
            self._model = b""
            self._go.wait()
            if self._feeds is not None:
                self._out = sess.run(self.names, dict(self._feeds))
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e

    def start(self, feeds: Mapping[str, np.ndarray]) -> None:
        self._feeds = feeds
        self._go.set()

    def take_data(self) -> bytes:
        """The serialized model, handed over (serialized again if asked twice); the unmarked
        session's own reference to the same bytes goes once that session is built."""
        data, self.data = self.data, b""
        return data or self._proto.SerializeToString()

    def cancel(self) -> None:
        self._go.set()

    def outputs(self) -> dict[str, Any]:
        self._thread.join()
        if isinstance(self._error, UnsupportedModelError):
            raise self._error
        if self._error is not None:
            e = self._error
            raise UnsupportedModelError(f"ONNX Runtime failed the unmarked run with every optimization on: "
                                        f"{type(e).__name__}: {e}") from e
        if self._out is None:
            raise RuntimeError("the unmarked run was cancelled")
        return dict(zip(self.names, self._out))


Stack = list[tuple[str, str]]  # (module path, class name), the root ('') first


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


# the exporter's form, read without the Python parser: ['', 'h.0', 'view_3'] (module paths and names
# hold no quote or backslash); anything else goes through ast.literal_eval
_PLAIN_LIST = re.compile(r"\[(?:'[^'\\]*'(?:, '[^'\\]*')*)?\]")
_ITEM = re.compile(r"'([^'\\]*)'")


def _literal_list(raw: str, key: str, where: str) -> list[str]:
    if _PLAIN_LIST.fullmatch(raw):
        return _ITEM.findall(raw)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModelError(f"{where}: metadata {key} is not a Python list of strings: {raw[:120]!r}")
    return value


def _head(raw: str, key: str, where: str, memo: dict[str, list[str]]) -> list[str]:
    """A metadata list without its last item (the FX node's own name), parsed once per graph for
    every node sharing the items before it: ``"['', 'h.0', 'view_3']"`` is read as the list
    ``"['', 'h.0']"`` (memoized) plus a plain last item; anything else is parsed whole."""
    cut = raw.rfind(", '")
    tail = raw[cut + 3:]
    if cut > 0 and tail.endswith("']") and "'" not in tail[:-2] and "\\" not in tail:
        head = raw[:cut]
        got = memo.get(head)
        if got is None:
            try:
                got = memo[head] = _literal_list(head + "]", key, where)
            except UnsupportedModelError:  # named by the whole value
                got = _literal_list(raw, key, where)[:-1]
        return got
    return _literal_list(raw, key, where)[:-1]


def node_stack(node: Any, index: int, memo: dict[str, Any] | None = None) -> Stack | None:
    """The module calls a node's metadata names (root first, the node's own name dropped), or None
    when it has none. ``memo``: one dict per graph, shared by its nodes (most repeat their
    module path's items)."""
    memo = {} if memo is None else memo
    raw = classes_raw = None
    for p in node.metadata_props:
        if p.key == SCOPES_KEY:
            raw = p.value
        elif p.key == CLASSES_KEY:
            classes_raw = p.value
    if raw is None:
        return None
    where = f"ONNX node {node.name or index!r} ({node.op_type})"
    scopes = _head(raw, SCOPES_KEY, where, memo.setdefault(SCOPES_KEY, {}))
    classes = [] if classes_raw is None else _head(classes_raw, CLASSES_KEY, where, memo.setdefault(CLASSES_KEY, {}))
    key = (tuple(scopes), tuple(classes))
    stacks = memo.setdefault("stacks", {})
    got = stacks.get(key)
    if got is None:
        if len(classes) != len(scopes):
            classes = [""] * len(scopes)
        got = stacks[key] = [(p, _short(c)) for p, c in zip(scopes, classes)]
    return list(got)


_GRAPH_ATTRS = (0, 5, 10)  # AttributeProto.UNDEFINED (untyped: looked into), GRAPH, GRAPHS


def _reads(node: Any) -> list[str]:
    """The values a node reads: its inputs and the outer values its subgraphs (If, Loop) read."""
    out = [v for v in node.input if v]
    for attr in node.attribute:
        if attr.type not in _GRAPH_ATTRS:  # typed as another kind: ONNX Runtime runs no subgraph of it
            continue
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for g in graphs:
            local = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                local.update(v for v in n.output if v)
            for n in g.node:
                out.extend(v for v in _reads(n) if v not in local)
    return out


@dataclass
class OnnxScope:
    """One module call in the ONNX graph: its nodes (children's included), in graph order, and
    the values leaving it."""

    path: str
    call: int
    type_name: str
    depth: int
    nodes: list[int] = field(default_factory=list)
    escaping: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)  # values computed outside it that it reads


class OnnxGraph:
    """Module calls of an exported ONNX model (module docstring). ``calls_of`` answers how many
    calls the golden has of a module path (None: no golden), to tell a module's repeated calls
    apart from one call whose nodes an optimizer moved."""

    def __init__(self, proto: Any, calls_of: Callable[[str], int | None] = lambda path: None):
        g = proto.graph
        self.proto = proto
        self.nodes = list(g.node)
        self.initializers = {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
        self.inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.outputs = [o.name for o in g.output]
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = {}
        self.reads = [_reads(n) for n in self.nodes]
        for i, n in enumerate(self.nodes):
            for v in n.output:
                if v:
                    self.producer[v] = i
            for v in self.reads[i]:
                self.readers.setdefault(v, []).append(i)
        memo: dict[str, Any] = {}
        own = [node_stack(n, i, memo) for i, n in enumerate(self.nodes)]
        self.with_metadata = sum(1 for s in own if s is not None)
        self.root_type = next((s[0][1] for s in own if s and s[0][0] == ""), "")
        self.stacks = self._resolve(own)
        self.inherited = sum(1 for s, o in zip(self.stacks, own) if o is None and len(s) > 1)
        self.ambiguous: dict[str, str] = {}
        self._const_memo: dict[str, bool] = {}
        self.scopes = self._scopes(calls_of)

    def _resolve(self, own: list[Stack | None]) -> list[Stack]:
        """Every node's stack: its own, or the module calls shared by every node it reads and
        every node reading it (a pass's node between two layers is their common parent's)."""
        out: list[Stack | None] = list(own)
        for i, stack in enumerate(own):
            if stack is not None:
                continue
            near = [self.producer[v] for v in self.reads[i] if v in self.producer]
            near += [j for v in self.nodes[i].output if v for j in self.readers.get(v, ())]
            stacks = [out[j] or [] for j in near if j != i]  # (one still unresolved counts as the root's)
            out[i] = common_prefix(stacks)
        return [s or [] for s in out]

    def _scopes(self, calls_of: Callable[[str], int | None]) -> list[OnnxScope]:
        members: dict[str, list[int]] = {}
        info: dict[str, tuple[str, int]] = {}
        for i, stack in enumerate(self.stacks):
            for depth, (path, cls) in enumerate(stack):
                if path == "":
                    continue
                members.setdefault(path, []).append(i)
                info.setdefault(path, (cls, depth))
        outputs = set(self.outputs)
        found: list[OnnxScope] = []
        for path, idx in members.items():
            runs: list[list[int]] = [[idx[0]]]
            for a, b in zip(idx, idx[1:]):
                if b - a > 1:
                    runs.append([])
                runs[-1].append(b)
            want = calls_of(path)
            if want is not None and want > 1 and len(runs) != want:
                self.ambiguous[path] = (f"{len(runs)} separate runs of ONNX nodes carry its scope for {want} calls in "
                                        f"the golden: which nodes belong to which call cannot be told")
                continue
            groups = [idx] if (want is not None and want <= 1) else runs
            cls, depth = info[path]
            for k, nodes in enumerate(groups):
                found.append(OnnxScope(path, k, cls, depth, nodes))
        # which calls each node is inside (by index in found); a value leaves call k when a node in
        # k reads it from a node outside k, or a node in k makes it and a node outside k (or the
        # graph's outputs) reads it: one pass over the nodes, each value's readers intersected once
        within: list[set[int]] = [set() for _ in self.nodes]
        for k, s in enumerate(found):
            for i in s.nodes:
                within[i].add(k)
        none: set[int] = set()
        seen: list[dict[str, None]] = [{} for _ in found]
        handed: list[list[str]] = [[] for _ in found]
        for i, node in enumerate(self.nodes):
            mine = within[i]
            if not mine:
                continue
            for v in self.reads[i]:
                if v not in self.initializers:
                    q = self.producer.get(v)
                    for k in (mine if q is None else mine - within[q]):
                        seen[k].setdefault(v, None)
            # an input handed on (a residual) is not a value the call computed
            passing: set[int] = none
            if node.op_type == "Identity" and node.input:
                q = self.producer.get(node.input[0])
                passing = mine if q is None else mine - within[q]
            for v in node.output:
                if not v:
                    continue
                if v in outputs:
                    leaves = mine
                else:
                    rs = self.readers.get(v, ())
                    leaves = mine.difference(within[rs[0]].intersection(*(within[r] for r in rs[1:]))) if rs else none
                for k in leaves:
                    (handed[k] if k in passing else found[k].escaping).append(v)
        for k, s in enumerate(found):
            if not s.escaping:  # a call that only hands its input on (an eval-mode dropout): that is its output
                s.escaping = handed[k]
            s.external = [v for v in seen[k] if not self._constant(v, self._const_memo)]
        return sorted(found, key=lambda s: (s.nodes[-1], -s.depth))

    def _constant(self, value: str, memo: dict[str, bool] | None = None) -> bool:
        """Whether a value is computed from initializers and constants alone (no model input)."""
        memo = {} if memo is None else memo
        if value in memo:
            return memo[value]
        if value in self.initializers:
            return True
        j = self.producer.get(value)
        ok = j is not None and all(self._constant(v, memo) for v in self.reads[j])
        memo[value] = ok
        return ok

    def check_feeds(self, feeds: Mapping[str, np.ndarray], what: str) -> None:
        """Refuse inputs the model's declared input types cannot take, naming both (a golden of
        another model, inputs of another shape), before ONNX Runtime does so less clearly."""
        onnx, _ = require_onnx()
        for vi in self.proto.graph.input:
            if vi.name not in feeds or not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            a = feeds[vi.name]
            want = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else None
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField(
                "shape") else None
            shape_ok = dims is None or (len(dims) == a.ndim and all(d is None or d == n for d, n in zip(dims, a.shape)))
            if (want is not None and a.dtype != want) or not shape_ok:
                declared = "x".join("?" if d is None else str(d) for d in dims or ()) or "scalar"
                raise UnsupportedModelError(
                    f"{what} for ONNX input {vi.name!r} is {a.dtype} of shape {tuple(a.shape)}, but the model takes "
                    f"{want if want is not None else 'any type'} of shape [{declared}]: the golden or the inputs are "
                    f"of another model")

    def owned(self) -> set[tuple[str, int]]:
        """The module calls that own at least one node."""
        return {(s.path, s.call) for s in self.scopes}


def to_tensor(a: Any) -> torch.Tensor:
    """An ONNX Runtime result as a tensor (shared memory; a 0-d result stays 0-d)."""
    arr = np.asarray(a)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def _sig(a: Any) -> Signature | None:
    if a is None:
        return None
    arr = np.asarray(a)
    try:
        dtype = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
    except TypeError:  # strings, objects: no tensor
        return None
    return tuple(int(s) for s in arr.shape), str(dtype).removeprefix("torch.")


class OrtSource:
    """A :class:`~activation_guard.values.calls.LiveSource` over an ONNX model in ONNX Runtime
    (module docstring). ``feeds`` are the model's inputs by ONNX input name; ``golden`` answers a
    golden call's entry by (live name, call); ``golden_calls`` lists the golden's selected calls as
    (live name, entry); ``wanted`` filters module paths; ``same_dtype=False`` pairs values with
    golden outputs by shape alone (a model converted to another float precision)."""

    def __init__(self, graph: OnnxGraph, feeds: Mapping[str, np.ndarray], *,
                 golden: Callable[[str, int], CallEntry | None], golden_calls: Sequence[tuple[str, CallEntry]],
                 wanted: Callable[[str], bool] = lambda name: True, optimization: Optimization = "off",
                 label: str = "ONNX model", same_dtype: bool = True,
                 resolve: Callable[[LeafEntry], LeafEntry] = lambda leaf: leaf, final_run: FinalRun | None = None):
        self.graph, self.feeds, self.resolve = graph, dict(feeds), resolve
        self.golden, self.golden_calls, self.wanted = golden, golden_calls, wanted
        self.optimization, self.label, self.same_dtype = optimization, label, same_dtype
        self.skipped: list[Skipped] = []
        self.mapped: dict[tuple[str, int], dict[str, str]] = {}  # per compared call: golden path -> value
        self.golden_of: dict[str, LeafEntry] = {}  # value -> the golden output it is
        self.values: dict[str, Any] = {}
        self.after: Callable[[OnnxScope], None] | None = None  # called after each compared call (replay)
        self.compared = 0
        self.fetched = 0
        self.output: Any = None
        self.final_change: str | None = None  # how the unmarked optimized run's outputs differ from the marked run's
        self.final: dict[str, Any] = {}
        self.final_run = final_run
        self.replayed_outside: list[str] = []  # module paths whose nodes a replay computed live

    def describe(self) -> str:
        g = self.graph
        mode = {"off": "graph optimizations off (every value as exported: a faithful per-module map)",
                "basic": "basic graph optimizations", "default": "every graph optimization (ORT's default)"}[
            self.optimization]
        bare = len(g.nodes) - g.with_metadata
        return (f"live values from the {self.label} in ONNX Runtime ({PROVIDER}), {mode}: {len(g.scopes)} module "
                f"calls named by the nodes' name scopes, {self.fetched} values fetched in one run; {bare} "
                f"of {len(g.nodes)} nodes have no scope metadata ({g.inherited} given to the module call around them); "
                f"the model's outputs are compared from a second, unmarked run with every optimization on")

    def _fetch(self) -> list[str]:
        g = self.graph
        names: dict[str, None] = {}
        for s in g.scopes:
            if self.wanted(s.path):
                names.update(dict.fromkeys(s.escaping))
                names.update(dict.fromkeys(v for v in s.external if v not in g.initializers))
        for v in g.inputs:
            names.pop(v, None)
        for v in g.outputs:
            names.pop(v, None)
        return list(names)

    def run(self) -> None:
        """One marked run (every module call's values); the unmarked, fully optimized run
        (:class:`FinalRun`) runs beside it and is awaited for the model's outputs."""
        onnx, _ = require_onnx()
        extra = self._fetch()
        if self.final_run is None:
            self.final_run = FinalRun(self.graph.proto)
        self.final_run.start(self.feeds)
        # the model with the values added as outputs, without serializing it again (nor touching
        # the given ModelProto): a second graph record holding only those outputs, appended to the
        # serialized model; protobuf merges a repeated message field's records, appending their
        # repeated fields, so this parses as the model with the outputs appended
        more = onnx.ModelProto(graph=onnx.GraphProto(output=[onnx.ValueInfoProto(name=v) for v in extra]))
        marked = self.final_run.take_data() + more.SerializeToString()
        names = [*self.graph.outputs, *extra]
        sess = session(marked, self.optimization, split_cores()[0])
        del marked
        try:
            got = sess.run(names, self.feeds)
        except Exception as e:
            raise UnsupportedModelError(f"ONNX Runtime failed to run the {self.label}: {type(e).__name__}: "
                                        f"{e}") from e
        self.values = dict(zip(names, got))
        self.fetched = len(names)

    def final_outputs(self) -> dict[str, Any]:
        """The unmarked, fully optimized run's outputs, and a note when they differ from the marked run's."""
        if not self.final and self.final_run is not None:
            self.final = self.final_run.outputs()
            worst = 0.0
            for name, a in self.final.items():
                b = self.values.get(name)
                if b is not None and np.asarray(a).dtype.kind == "f" and np.asarray(a).shape == np.asarray(b).shape:
                    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
                    worst = max(worst, float(np.nanmax(d)) if d.size else 0.0)
            self.final_change = None if worst == 0 else (
                f"the unmarked run with every optimization on differs from the marked run by at most {worst:.3g} in "
                f"the model's outputs (optimizations the marked values prevented)")
        return self.final

    def calls(self) -> Iterator[LiveCall]:
        if not self.values:
            self.run()
        g = self.graph
        last: dict[str, int] = {}  # a value is released once no later call reads or returns it
        for k, s in enumerate(g.scopes):
            for v in (*s.escaping, *s.external):
                last[v] = k
        met: set[tuple[str, int]] = set()
        for k, s in enumerate(g.scopes):
            if self.wanted(s.path):
                met.add((s.path, s.call))
                yield self._call(s)
                if self.after is not None and (s.path, s.call) in self.mapped:
                    self.after(s)
            for v in (*s.escaping, *s.external):
                if last.get(v) == k and v not in g.outputs:
                    self.values.pop(v, None)
        owned = {s.path for s in g.scopes}
        for name, c in self.golden_calls:
            if name and (name, c.call) not in met and self.wanted(name):
                self.skipped.append(Skipped(name, c.call, self._why_missing(name, c, owned), True))
                yield LiveCall(name, c.call, c.type_name, list, only=frozenset())
        yield self._root()

    def _why_missing(self, name: str, c: CallEntry, owned: set[str]) -> str:
        if name in self.graph.ambiguous:
            return self.graph.ambiguous[name]
        if name in owned:
            return "the ONNX model has fewer calls of this module than the golden"
        ins = [self.resolve(i) for i in c.inputs or () if i.kind in ("tensor", "alias")]
        crcs = {(i.crc32, tuple(i.shape), i.dtype) for i in ins if i.kind == "tensor"}
        outs = [x for x in c.leaves if x.kind in TENSOR_KINDS]
        if c.inputs is not None and outs and all(x.kind == "tensor" and (x.crc32, tuple(x.shape), x.dtype) in crcs
                                                 for x in outs):
            return ("no ONNX node carries its scope: it returns its input unchanged (an eval-mode dropout, an "
                    "identity), and the exporter removed it")
        readers = [n for n, cc in self.golden_calls if n and any(
            i.alias is not None and (i.alias[0], i.alias[1]) == (c.name, c.call) for i in cc.inputs or ())]
        into = (f" or merged it into the nodes of {', '.join(repr(r) for r in readers[:3])}, whose values carry "
                f"its computation (a BatchNorm merged into the Conv before it)") if readers else " or removed it"
        return f"no ONNX node carries its scope: the exporter folded it into a constant (a position table){into}"

    def _call(self, s: OnnxScope) -> LiveCall:
        entry = self.golden(s.path, s.call)
        if entry is None:  # not in the golden: the comparator names it unexpected
            vals = [to_tensor(self.values[v]) for v in s.escaping]
            leaves = flatten(vals[0] if len(vals) == 1 else tuple(vals), fields=True)
            return LiveCall(s.path, s.call, s.type_name, lambda: leaves)
        mapped, left = assign_outputs(entry.leaves, [_sig(self.values.get(v)) for v in s.escaping], self.same_dtype)
        if book_outputs(s.path, s.call, s.escaping, entry.leaves, mapped, left, self.skipped, self.mapped,
                        self.golden_of):
            self.compared += 1
        leaves = [Leaf(path, "tensor", tensor=to_tensor(self.values[s.escaping[i]])) for path, i in mapped.items()]
        return LiveCall(s.path, s.call, s.type_name, lambda: leaves, only=frozenset(mapped))

    def _root(self) -> LiveCall:
        final = self.final_outputs()
        outs = [final[v] for v in self.graph.outputs]
        entry = self.golden("", 0)
        root_type = self.graph.root_type or "ModelProto"
        if entry is None:
            tensors = [to_tensor(a) for a in outs]
            self.output = tensors[0] if len(tensors) == 1 else tuple(tensors)
            return LiveCall("", 0, root_type, lambda: flatten(self.output, fields=True))
        tensors = [to_tensor(a) for a in outs]
        self.output = tensors[0] if len(tensors) == 1 else tuple(tensors)
        golden = [x for x in entry.leaves if x.kind in TENSOR_KINDS]
        sigs = [_sig(a) for a in outs]

        def same(x: LeafEntry, s: Signature | None) -> bool:
            return s is not None and tuple(x.shape) == s[0] and (not self.same_dtype or (x.dtype or "") == s[1])

        if len(golden) == len(outs) and all(same(x, s) for x, s in zip(golden, sigs)):
            # the exporter returns the eager output's tensors flattened in order
            mapped = {x.path: i for i, x in enumerate(golden)}
            left = [(x.path, f"a constant {x.type_name or x.kind} output is not a value in the graph")
                    for x in entry.leaves if x.kind not in (*TENSOR_KINDS, "ref")]
        else:
            mapped, left = assign_outputs(entry.leaves, sigs, self.same_dtype)
        for path, why in left:
            self.skipped.append(Skipped("", 0, f"{output_name(path)}: {why}", not mapped))
        self.compared += 1
        leaves = [Leaf(path, "tensor", tensor=tensors[i]) for path, i in mapped.items()]
        return LiveCall("", 0, entry.type_name or root_type, lambda: leaves, only=frozenset(mapped))

    def notes(self) -> list[str]:
        """What the ONNX model could not be compared on, per module call, with the reason."""
        out = []
        if self.final_change:
            out.append(f"{self.label}: {self.final_change}")
        if self.skipped:
            shown = self.skipped[:20]
            more = len(self.skipped) - len(shown)
            head = (f"{self.label}: {self.compared} module calls compared; not comparable: "
                    + "; ".join(f"{k.name or '<root>'!r} call {k.call} {k.reason}" for k in shown))
            out.append(head + (f"; and {more} more" if more else ""))
        return out

    # ------------------------------------------------------------------ replay

    def replay(self, s: OnnxScope, entry: CallEntry, load: Callable[[LeafEntry, str], torch.Tensor],
               resolve: Callable[[LeafEntry], LeafEntry], model_inputs: Mapping[str, np.ndarray] | None
               ) -> dict[str, torch.Tensor] | str:
        """The call's mapped outputs (by golden path) re-computed in ONNX Runtime on the golden's
        values, or why they cannot be. The subgraph is the call's own nodes, plus the nodes outside
        it that compute a value it reads for which the golden holds no value (code of the enclosing
        module, constants), back to values the golden has: the call's recorded inputs (told apart
        by shape and dtype), earlier calls' outputs the ONNX model maps, or the model's inputs."""
        onnx, _ = require_onnx()
        g = self.graph
        where = f"layer {s.path!r} call {s.call}"
        mapped = self.mapped[(s.path, s.call)]
        known: dict[str, LeafEntry] = {}
        acts = [v for v in s.external if v in self.values]
        if entry.inputs is not None:
            recorded = [resolve(x) for x in entry.inputs if x.kind in ("tensor", "alias")]
            by_path = {x.path: x for x in recorded}
            pairs, _ = assign_outputs(recorded, [_sig(self.values[v]) for v in acts], self.same_dtype)
            for path, i in pairs.items():
                known[acts[i]] = by_path[path]
        inside = set(s.nodes)
        nodes: set[int] = set(inside)
        inputs: dict[str, None] = {}
        stack = [v for i in s.nodes for v in g.reads[i]]
        while stack:
            v = stack.pop()
            if v in g.initializers or v in inputs or g.producer.get(v, -1) in nodes:
                continue
            if v in known or v in self.golden_of or v in g.inputs:
                inputs[v] = None
                continue
            j = g.producer.get(v)
            if j is None:
                return f"value {v!r} it reads is produced by no node and is no model input"
            nodes.add(j)
            stack.extend(g.reads[j])
        feeds: dict[str, np.ndarray] = {}
        for v in inputs:
            live = self.values.get(v, self.feeds.get(v))
            if v in known or v in self.golden_of:
                t = load(known.get(v) or self.golden_of[v], f"{where} input {v!r}")
                dt = np.asarray(live).dtype if live is not None else None
                arr = t.detach().cpu().numpy()
                feeds[v] = arr.astype(dt) if dt is not None and arr.dtype != dt else arr
            elif model_inputs is not None and v in model_inputs:
                feeds[v] = model_inputs[v]
            else:
                return f"model input {v!r}: the golden's recorded model inputs are not available"
        used = [g.nodes[j] for j in sorted(nodes)]
        read = {r for j in nodes for r in g.reads[j]}
        inits = [t for t in g.proto.graph.initializer if t.name in read]
        ins = [onnx.helper.make_tensor_value_info(v, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
               for v, a in feeds.items()]
        targets = list(mapped.items())
        graph = onnx.helper.make_graph(used, f"replay of {s.path}", ins,
                                       [onnx.ValueInfoProto(name=v) for _, v in targets], initializer=inits)
        sub = onnx.helper.make_model(graph, opset_imports=list(g.proto.opset_import),
                                     ir_version=g.proto.ir_version)
        sub.functions.extend(g.proto.functions)
        try:
            got = session(sub, self.optimization).run([v for _, v in targets], feeds)
        except Exception as e:
            why = " ".join(str(e).split())[:300]
            return f"ONNX Runtime could not run the call's subgraph ({type(e).__name__}: {why})"
        self.replayed_outside = sorted({path for j in nodes - inside for path, _ in g.stacks[j][-1:]} or set())
        return {path: to_tensor(a) for (path, _), a in zip(targets, got)}
