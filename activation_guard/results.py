"""Verdicts: what one output leaf, and one layer call, compared to.

Plain dataclasses with every number a report shows as a field of its own (text, JSON, HTML and
Markdown reports read fields, never each other's strings), and exact ``to_dict``/``from_dict``
round trips so a report written by another process (an xdist worker, a CI job) renders the same.

Over the ~400 lines we aim for: every verdict type, with its exact ``to_dict``/``from_dict`` round
trip, sits in one module, so no renderer parses another's strings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from ._core.kernel import TensorStats, unravel
from ._core.metrics import Energy, total
from ._core.slots import SLOTS

# what a leaf or a layer call compared to; "local_shard" (distributed): a rank's piece of a value whose
# full shape the golden holds. The strings are what JSON reports and the text say.
Status = Literal["structure", "shape", "local_shard", "dtype", "missing", "unexpected", "nonfinite", "diverged",
                 "match"]
STATUS_ORDER: tuple[Status, ...] = get_args(Status)
# which pass a row belongs to: the forward, a gradient in the backward, a parameter's gradient
Phase = Literal["forward", "backward", "param-grad"]
# how live values relate to the golden's at the mismatched elements (Where.relation)
Relation = Literal["scale", "offset", "permutation", "sign", "column-scale", "row-scale", "broad", "unknown",
                   "sampled"]
PHASES: tuple[Phase, ...] = get_args(Phase)
# a fingerprinted output's numbers (LeafResult fields): estimates, not measured differences
ESTIMATE_NUMBERS = ("estimated_l2", "l2_bound", "l2_threshold", "false_alarm")
PHASES = ("forward", "backward", "param-grad")


def json_number(x: Any) -> Any:
    """Numbers as JSON allows them (NaN/Inf as strings, complex as [re, im])."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, complex):
        return [json_number(x.real), json_number(x.imag)]
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return x
    if isinstance(x, int):
        return x
    return str(x)


def from_json_number(x: Any) -> Any:
    """Inverse of :func:`json_number` for values read back from a JSON report."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, list) and len(x) == 2:
        return complex(from_json_number(x[0]), from_json_number(x[1]))
    return x


def _fields_from_dict(cls: Any, d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TypeError(f"expected a dict for {cls.__name__}, got {type(d).__name__}")
    names = set(cls.__dataclass_fields__)
    out = {k: v for k, v in d.items() if k in names}
    for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple", "own_max_abs_diff",
              "own_max_rel_diff", "inherited_max_abs_diff", *ESTIMATE_NUMBERS):
        if k in out:
            out[k] = from_json_number(out[k])
    for k in ("shape", "live_shape", "index"):
        if isinstance(out.get(k), list):
            out[k] = tuple(out[k])
    if out.get("where") is not None:
        out["where"] = Where.from_dict(out["where"])
    for k in ENERGY_FIELDS:
        if k in out:
            out[k] = Energy.from_dict(out[k])
    if "min_sqnr_db" in out:
        out["min_sqnr_db"] = from_json_number(out["min_sqnr_db"])
    return out


# error energies (:mod:`._core.metrics`): the metrics a ``metric``/``min_sqnr_db`` compare shows follow from them
ENERGY_FIELDS = ("energy", "own_energy", "inherited_energy")


def _energies_to_json(d: dict[str, Any], obj: Any) -> None:
    for k in ENERGY_FIELDS:
        if k in d:
            e = getattr(obj, k)
            d[k] = None if e is None else e.to_dict()


@dataclass
class DimWhere:
    """Where along one dimension of an output the mismatched elements lie."""

    dim: int
    size: int
    count: int  # positions along this dimension holding at least one mismatched element
    ranges: list[list[int]]  # those positions as inclusive [first, last] runs (the first few)
    text: str  # "only at 64-127", "all positions", "index 2 only"


@dataclass
class Heat:
    """A diverged output reduced to a small 2-D grid for a heatmap (at most ``MAX_CELLS`` a side):
    ``diff`` the largest |live - golden| in each cell, ``golden``/``live`` their means, ``bad`` 1 where a
    cell holds a mismatched element. ``rows``/``cols`` say which dimensions the axes are and how
    the others were reduced."""

    rows: str
    cols: str
    reduced: str
    diff: list[list[float]]
    golden: list[list[float]]
    live: list[list[float]]
    bad: list[list[int]]


@dataclass
class Where:
    """The shape of a divergence (:mod:`activation_guard.judges.where`): per dimension where the
    mismatches lie, and the relation between live and golden values at them, if there is one.

    ``relation``: ``scale`` (live = ``factor`` x golden), ``offset`` (live = golden + ``offset``),
    ``permutation`` (the golden's values moved along ``perm_dim``), ``sign`` (live = -golden),
    ``column-scale`` (one factor per position of the last dimension, the same across the others:
    a per-channel scale), ``row-scale`` (one factor per slice along the last dimension: a
    normalisation change), both with the factors' range in ``factor_min``/``factor_max``,
    ``broad`` (none of these), ``unknown`` (the description failed: ``text`` says why; the verdict
    stands), or ``sampled`` (a fingerprinted output: only its exact samples were
    seen, and nothing is claimed beyond them). ``border``: the mismatches lie within this many
    positions of the edges of the last two dimensions (a padding change), else None."""

    relation: Relation
    text: str  # the relation in words
    dims: list[DimWhere] = field(default_factory=list)
    factor: float | None = None
    offset: float | None = None
    perm_dim: int | None = None
    moved: int = 0  # permutation: positions along perm_dim holding another position's values
    sign_flips: int = 0  # mismatched elements equal to -golden within tolerance
    border: int | None = None
    heat: Heat | None = None
    requested: bool = False
    factor_min: float | None = None
    factor_max: float | None = None  # described because the `where` option named its layer

    def lines(self) -> list[str]:
        """The words, one line per dimension then the relation (border, when found, first)."""
        out = [f"dim {d.dim} ({d.size}): {d.text}" for d in self.dims]
        if self.border is not None:
            out.append(f"border: every mismatch lies within {self.border} position(s) of the edges of the last two "
                       f"dimensions (padding?)")
        return [*out, self.text]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("factor", "offset", "factor_min", "factor_max"):
            d[k] = json_number(d[k])
        if d["heat"] is not None:  # an inf |d| (a new Inf) is written as JSON allows
            for k in ("diff", "golden", "live"):
                d["heat"][k] = [[json_number(v) for v in row] for row in d["heat"][k]]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Where:
        if not isinstance(d, dict):
            raise TypeError(f"expected a dict for Where, got {type(d).__name__}")
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("factor", "offset", "factor_min", "factor_max"):
            if k in kw:
                kw[k] = from_json_number(kw[k])
        kw["dims"] = [DimWhere(**{k: v for k, v in x.items() if k in DimWhere.__dataclass_fields__})
                      for x in kw.get("dims") or []]
        if isinstance(kw.get("heat"), dict):
            h = {k: v for k, v in kw["heat"].items() if k in Heat.__dataclass_fields__}
            for k in ("diff", "golden", "live"):
                h[k] = [[from_json_number(v) for v in row] for row in h.get(k) or []]
            kw["heat"] = Heat(**h)
        return cls(**kw)


@dataclass(**SLOTS)
class LeafResult:
    """One output leaf of one layer call."""

    path: str
    status: Status
    detail: str = ""
    dtype: str | None = None
    live_dtype: str | None = None
    shape: tuple[int, ...] | None = None
    live_shape: tuple[int, ...] | None = None
    numel: int = 0
    mismatched: int = 0
    nonfinite_new: int = 0
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    index: tuple[int, ...] | None = None
    golden_value: Any = None
    live_value: Any = None
    rtol: float | None = None
    atol: float | None = None
    tolerance_source: str | None = None
    error_multiple: float | None = None  # calibrated mode: error / allowed noise
    type_name: str | None = None  # the live value's Python type, when it is not a plain tensor
    type_only: bool = False  # an opaque object (a cache, a generator): only its type was compared
    ranks: list[int] | None = None  # distributed: ranks holding the worst element of a gathered value
    # judged against a fingerprint (docs/fingerprint.md): "l2" (strict rule) or "rms" (calibrated rule
    # in L2 form); None for outputs compared value by value. The numbers are estimates from the sketch:
    estimate: str | None = None
    fingerprint_check: str | None = None  # the check that failed: nonfinite, sample, max, min, sum, sketch
    estimated_l2: float | None = None  # the sketch's estimate of ||live - golden||_2 (median of its rows)
    l2_bound: float | None = None  # ||live - golden||_2 is at most this if every element is within tolerance
    l2_threshold: float | None = None  # what each row's estimate is compared with (c x bound + rounding)
    sketch_rows_over: int = 0  # rows above the threshold (a majority fails)
    sketch_rows: int = 0
    sampled: int = 0  # elements checked exactly (bit-exact samples); ``mismatched`` counts those outside
    false_alarm: float | None = None  # bound on P(a within-tolerance run fails the sketch check)
    where: Where | None = None  # the shape of the divergence, for the first diverged call and requested layers
    # error energy against the golden (a ``metric`` or ``min_sqnr_db`` compare: every metric follows from it)
    energy: Energy | None = None
    min_sqnr_db: float | None = None  # the SQNR threshold that judged it (a tolerances pattern's min_sqnr_db)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["where"] = None if self.where is None else self.where.to_dict()
        _energies_to_json(d, self)
        for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple", *ESTIMATE_NUMBERS):
            d[k] = json_number(d[k])
        for k in ("shape", "live_shape", "index"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeafResult:
        """Rebuild from :meth:`to_dict` output (e.g. a JSON report read back)."""
        return cls(**_fields_from_dict(cls, d))


def out_name(path: str) -> str:
    """How a report names an output leaf: the bare output, or the one at a path inside it."""
    return f"output {path}" if path else "the output"


def worst_status(statuses: list[Status]) -> Status:
    for s in STATUS_ORDER:
        if s in statuses:
            return s
    return "match"


@dataclass(**SLOTS)
class LayerResult:
    """The verdict for one call of one module.

    ``max_abs_diff``/``max_rel_diff``/``mismatched``/``numel`` aggregate over the call's output
    leaves; ``path``/``index``/``golden_value``/``live_value`` describe the worst element of the
    worst leaf, and ``rtol``/``atol`` the tolerance applied to it.
    """

    name: str
    call: int
    status: Status
    type_name: str = ""
    position: int | None = None  # 0-based index in the live execution order
    golden_position: int | None = None
    golden_name: str | None = None  # differs from name when `rename` mapped it
    golden_type_name: str | None = None  # the golden's module class, when the live module's (type_name) differs
    detail: str = ""
    numel: int = 0
    mismatched: int = 0
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    path: str | None = None
    index: tuple[int, ...] | None = None
    golden_value: Any = None
    live_value: Any = None
    rtol: float | None = None
    atol: float | None = None
    tolerance_source: str | None = None
    error_multiple: float | None = None  # calibrated mode: error / allowed noise
    nonfinite_new: int = 0  # NaN/Inf values the golden does not have at their places
    phase: Phase = "forward"
    wrt: str | None = None  # phase "backward": the gradient w.r.t. the call's "output" or "input"
    # replay: the layer re-run on the golden's inputs, compared with the golden output ("own error")
    own_status: Status | None = None
    own_max_abs_diff: float | None = None
    own_max_rel_diff: float | None = None
    inherited_status: Status | None = None  # replay="all": the output verdict, before own errors judged it
    inherited_max_abs_diff: float | None = None
    # error energies (pooled over the call's outputs): as judged, its replay's own, and the output's
    # before its own error judged it (replay="all"); and the SQNR threshold that judged it
    energy: Energy | None = None
    own_energy: Energy | None = None
    inherited_energy: Energy | None = None
    min_sqnr_db: float | None = None
    leaves: list[LeafResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "match"

    @property
    def label(self) -> str:
        if self.phase == "param-grad":  # gradients
            return f"{self.name or '<root>'} (param grads)"
        if self.phase == "backward":
            return f"{self.name or '<root>'}[{self.call}] (grad wrt {self.wrt or '?'})"
        return f"{self.name or '<root>'}[{self.call}]"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "leaves"}
        for k in ("max_abs_diff", "max_rel_diff", "golden_value", "live_value", "error_multiple", "own_max_abs_diff",
                  "own_max_rel_diff", "inherited_max_abs_diff"):
            d[k] = json_number(d[k])
        if d["index"] is not None:
            d["index"] = list(d["index"])
        _energies_to_json(d, self)
        d["min_sqnr_db"] = json_number(d["min_sqnr_db"])
        d["leaves"] = [leaf.to_dict() for leaf in self.leaves]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerResult:
        """Rebuild from :meth:`to_dict` output (e.g. a JSON report read back)."""
        kw = _fields_from_dict(cls, d)
        kw["leaves"] = [LeafResult.from_dict(x) for x in d.get("leaves") or []]
        return cls(**kw)

    @classmethod
    def from_leaves(cls, name: str, call: int, type_name: str, leaves: list[LeafResult], **kw: Any) -> LayerResult:
        if len(leaves) == 1:  # most layers return one tensor: the leaf's numbers are the layer's
            return cls._from_leaf(name, call, type_name, leaves[0], kw)
        status: Status = worst_status([leaf.status for leaf in leaves]) if leaves else "match"
        lr = cls(name, call, status, type_name, leaves=leaves, **kw)
        lr.numel = sum(leaf.numel for leaf in leaves)
        lr.mismatched = sum(leaf.mismatched for leaf in leaves)
        lr.nonfinite_new = sum(leaf.nonfinite_new for leaf in leaves)
        numeric = [leaf for leaf in leaves if leaf.max_abs_diff is not None]
        if numeric:
            lr.max_abs_diff = max(leaf.max_abs_diff for leaf in numeric)  # type: ignore[type-var]
            lr.max_rel_diff = max(leaf.max_rel_diff or 0.0 for leaf in numeric)
        multiples = [leaf.error_multiple for leaf in leaves if leaf.error_multiple is not None]
        if multiples:
            lr.error_multiple = max(multiples)
        lr.energy = total(leaf.energy for leaf in leaves)
        thresholds = [leaf.min_sqnr_db for leaf in leaves if leaf.min_sqnr_db is not None]
        if thresholds:
            lr.min_sqnr_db = max(thresholds)
        # the leaf to show: first leaf with the worst status, largest excess within it
        focus = [leaf for leaf in leaves if leaf.status == status] or leaves
        if focus:
            best = max(focus, key=lambda x: (
                x.max_abs_diff if x.max_abs_diff is not None and not math.isnan(x.max_abs_diff) else -1.0))
            if status != "match":
                best = next((x for x in focus if x.status == status and x.mismatched), best)
            lr.path = best.path
            lr.index = best.index
            lr.golden_value = best.golden_value
            lr.live_value = best.live_value
            lr.rtol, lr.atol, lr.tolerance_source = best.rtol, best.atol, best.tolerance_source
            if not lr.detail:
                lr.detail = best.detail
        return lr

    @classmethod
    def _from_leaf(cls, name: str, call: int, type_name: str, leaf: LeafResult, kw: dict[str, Any]) -> LayerResult:
        m = leaf.max_abs_diff
        return cls(name, call, leaf.status, type_name, leaves=[leaf], numel=leaf.numel, mismatched=leaf.mismatched,
                   nonfinite_new=leaf.nonfinite_new, max_abs_diff=m,
                   max_rel_diff=None if m is None else (leaf.max_rel_diff or 0.0), error_multiple=leaf.error_multiple,
                   path=leaf.path, index=leaf.index, golden_value=leaf.golden_value, live_value=leaf.live_value,
                   rtol=leaf.rtol, atol=leaf.atol, tolerance_source=leaf.tolerance_source, energy=leaf.energy,
                   min_sqnr_db=leaf.min_sqnr_db, detail=kw.pop("detail", "") or leaf.detail, **kw)


# fields an IdenticalCall sets when it is made; every other field is built from its facts on first read
_EAGER = ("name", "call", "status", "type_name", "position", "golden_position", "golden_name", "phase", "own_status")
_FIELDS = tuple(LayerResult.__dataclass_fields__)
_LAZY = frozenset(_FIELDS) - set(_EAGER)


class IdenticalCall(LayerResult):
    """A layer call whose one output was bit-identical to its golden: a ``LayerResult`` whose
    numbers are built only when one is read.

    Its verdict is settled when it is made (every byte equal: "match", zero differences, the
    first element as the worst). A deep model makes thousands of these per compare, and building
    two full result records for each was a quarter of compare's cost per layer call; most reports
    are only asked ``ok``. It holds the few facts the numbers follow from (``build``: a function
    returning the call's one ``LeafResult``, then its arguments: plain values taken when the call
    returned, the tolerance then in force among them, never the judge, spec or model), and fills
    every field from them on first read, leaving fields already assigned (a replay's own error) as
    they are. Two threads may fill one row at once: both build the same values. It is a
    ``LayerResult`` in every other way: same fields, ``to_dict``, equality.
    """

    __slots__ = ("_build",)
    _build: tuple[Any, ...]

    @classmethod
    def made(cls, name: str, call: int, type_name: str, position: int, golden_position: int | None,
             golden_name: str | None, build: tuple[Any, ...]) -> LayerResult:
        if not SLOTS:  # Python 3.9: fields with defaults are class attributes there, which would hide the lazy ones
            return LayerResult._from_leaf(name, call, type_name, build[0](*build[1:]), dict(
                position=position, golden_position=golden_position, golden_name=golden_name))
        self = cls.__new__(cls)
        self.name, self.call, self.status, self.type_name = name, call, "match", type_name
        self.position, self.golden_position, self.golden_name = position, golden_position, golden_name
        self.phase, self.own_status = "forward", None
        self._build = build
        return self

    @property
    def built(self) -> bool:
        """Whether its fields have been filled (reading any field but the eager ones fills them)."""
        try:
            object.__getattribute__(self, "leaves")
        except AttributeError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        """Equal to any ``LayerResult`` with the same fields (the dataclass's own ``__eq__``
        wants the same class, and which class holds a verdict is not part of it)."""
        if not isinstance(other, LayerResult):
            return NotImplemented
        return tuple(getattr(self, f) for f in _FIELDS) == tuple(getattr(other, f) for f in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, as LayerResult

    def __repr__(self) -> str:  # as a LayerResult's: which class holds a verdict is not part of it
        return "LayerResult" + LayerResult.__repr__(self)[len(type(self).__qualname__):]

    def __getattr__(self, attr: str) -> Any:  # only for fields not yet filled
        if attr not in _LAZY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        build = object.__getattribute__(self, "_build")
        leaf = build[0](*build[1:])
        full = LayerResult._from_leaf(self.name, self.call, self.type_name, leaf, {})
        for f in _LAZY:
            try:
                object.__getattribute__(self, f)
            except AttributeError:
                object.__setattr__(self, f, object.__getattribute__(full, f))
        return object.__getattribute__(self, attr)


def leaf_from_stats(path: str, dtype: str, live_dtype: str, shape: tuple[int, ...], st: TensorStats,
                    rtol: float, atol: float, source: str) -> LeafResult:
    """A leaf verdict from kernel statistics. ``detail`` stays empty: the mismatch count, new
    NaN/Inf count and worst element are fields the report renders itself."""
    status: Status = "match"
    if st.mismatched:
        status = "nonfinite" if st.nonfinite_new else "diverged"
    return LeafResult(
        path=path, status=status, dtype=dtype, live_dtype=live_dtype,
        shape=shape, live_shape=shape, numel=st.numel, mismatched=st.mismatched,
        nonfinite_new=st.nonfinite_new, max_abs_diff=st.max_abs_diff, max_rel_diff=st.max_rel_diff,
        index=unravel(st.worst_flat, shape) if st.worst_flat is not None and st.numel else None,
        golden_value=st.golden_value, live_value=st.live_value, rtol=rtol, atol=atol,
        tolerance_source=source,
    )


OriginKind = Literal["layer", "parent-code", "inputs", "unknown"]
ORIGIN_KINDS: tuple[OriginKind, ...] = get_args(OriginKind)


@dataclass
class Origin:
    """Where a difference was made, as replay tells it (``Report.origin``).

    ``kind``: ``layer`` (the layer computes differently on the golden's own inputs), ``parent-code``
    (code of ``name``'s forward between its children: the children compute the same on the
    golden's inputs, but ``child``'s inputs differ; ``previous`` is the child that returned just
    before it), ``inputs`` (the model's inputs differ) or ``unknown`` (``detail`` says why, e.g. a
    golden recorded without inputs). ``own_error`` is the largest difference of the replayed
    output from the golden output. ``maybe_code``: an ``unknown`` origin that names code (a
    module's own, the model's outside its module calls) as one of the explanations it could not
    tell apart; :attr:`names_code` says whether an origin names code at all."""

    name: str
    call: int
    kind: OriginKind
    own_error: float | None = None
    detail: str = ""
    type_name: str = ""
    child: str | None = None
    previous: str | None = None
    maybe_code: bool = False

    @property
    def names_code(self) -> bool:
        """The origin is code (a layer's own computation, a parent's between its children), or may be."""
        return self.kind in ("layer", "parent-code") or self.maybe_code

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["own_error"] = json_number(d["own_error"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Origin:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "own_error" in kw:
            kw["own_error"] = from_json_number(kw["own_error"])
        return cls(**kw)
