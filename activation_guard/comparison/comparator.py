"""The streaming comparator: meets each live layer call with its golden call and asks a judge.

It owns everything about *which* values meet: layer names (under ``rename``), call indices,
output paths, shapes, dtypes, layers that are missing from the live run or new in it, and where
each sits in execution order. Whether two tensors that met are close enough is the judge's
decision (:mod:`activation_guard.judges.strict`), so a new rule never touches this module.

Each call is compared as soon as the live layer returns (inside its forward hook, before an
in-place op can change the output), reading only that call's golden values: memory stays near
one layer's worth. :func:`activation_guard.api.diff` drives the same object from a second recording.

Matching knows one path scheme: the reader hands an older golden's call the live leaves under
the golden's own paths (:meth:`~activation_guard.store.reader.GoldenReader.live_view`). The
bit-identical fast path (deferred rows: :class:`~activation_guard.results.IdenticalCall`) sits in
the matching it short-cuts. How two leaves of one kind compare is in :mod:`.pairs`; the judging
itself in :mod:`activation_guard.judges.strict`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .._core.dtypes import BY_NAME, dtype_name, numpy_view, tensor_bytes, tensor_from_bytes
from .._core.tensors import is_plain_tensor
from ..capture.hooks import Frame
from ..distributed.transform import attribute
from ..judges.strict import Judge, LeafContext, identical_leaf
from ..judges.where import describe
from ..options.rename import apply_rename, renamed_patterns
from ..options.selection import Selector, selected
from ..options.spec import CompareSpec
from ..options.tolerances import Tolerance
from ..replay.args import root_inputs_match
from ..replay.callstart import remember_start
from ..replay.hints import string_hint
from ..replay.replay import REPLAYABLE, Replayer, inputs_origin, judge_by_own, keep_own
from ..results import IdenticalCall, LayerResult, LeafResult, Origin, Where
from ..store import CallEntry, GoldenReader, LeafEntry
from ..values.calls import LiveSource
from ..values.leaves import Leaf, LeafTransform, UnsupportedTensorError, flatten
from ..values.paths import is_fields
from .fingerprints import FingerprintJudge
from .golden_selection import Selection, recorded_selection, refuse_strays
from .pairs import PAIRS, kind_name, out_name, tensor_pair

# diverged calls (in execution order) whose shape of divergence is described and kept for a
# heatmap without being asked (the `where` option asks for more): the first is the report's
# subject, the next shows whether it propagates; each costs about two of the kernel's comparisons
# of that output, so more would take a failing compare past 5% more time (docs/performance.md)
DESCRIBED = 2


class StopForward(Exception):
    """Raised from a hook to end the forward early (``fail_fast``)."""


@dataclass(frozen=True)
class LiveInputs:
    """How the live model's inputs stand against the recording's, as the caller measured them
    before the forward: ``changed`` (any difference), ``replaced`` (by more than a floating cast),
    ``unverified`` (could not be told: replay="all" checks the model's own call first),
    ``objects_changed`` (an opaque object replays would get live)."""

    changed: bool = False
    replaced: bool = False
    unverified: bool = False
    objects_changed: bool = False


class Comparator:
    """Compares each live layer call against its golden as soon as the layer returns. Built
    complete: the caller passes the replayer, what it knows of the inputs and whether a layer
    selection leaves code unjudged; nothing is set on it afterwards."""

    def __init__(self, reader: GoldenReader, spec: CompareSpec, judge: Judge, *,
                 golden_filter: Selection | None = None, transform: LeafTransform | None = None,
                 fingerprints: FingerprintJudge | None = None, replayer: Replayer | None = None,
                 inputs: LiveInputs = LiveInputs(), partial_selection: bool = False):
        """``golden_filter``: the golden's own recorded selection, by golden name, when the hooks
        could not apply it (under ``rename``): a live layer outside it was never stored, so it is
        not "unexpected". ``transform``: applied to every hooked call's leaves before the golden is
        consulted (a multi-rank run's conversions, which are collectives: see dist_capture).
        ``fingerprints``: the rule for fingerprinted leaves (default: the one matching ``judge``)."""
        self.reader = reader
        self.transform = transform
        self.spec = spec
        self.judge = judge
        self.fingerprints = fingerprints
        self.golden_filter = golden_filter
        refuse_strays(reader)
        self.results: list[LayerResult] = []
        self.seen: set[tuple[str, int]] = set()
        self.live_to_golden: dict[str, str] = {}
        self.golden_calls: dict[str, int] = {}
        rules = spec.rename
        counts = self.golden_calls
        if rules:
            live_names = []
            for c in reader.calls:
                live = apply_rename(c.name, rules)
                live_names.append(live)
                prev = self.live_to_golden.get(live)
                if prev is not None and prev != c.name:
                    raise ValueError(f"rename maps golden layers {prev!r} and {c.name!r} both to {live!r}")
                self.live_to_golden[live] = c.name
        else:  # (the common case, per golden call on every compare: no rename to apply)
            live_names = [c.name for c in reader.calls]
            self.live_to_golden = dict(zip(live_names, live_names))
        for c in reader.calls:
            if c.call >= counts.get(c.name, 0):
                counts[c.name] = c.call + 1
        if spec.include is None and spec.exclude is None:
            self.golden_selected = list(reader.calls)
        else:
            wanted = Selector(spec.include, spec.exclude, live_names)
            self.golden_selected = [c for c, live in zip(reader.calls, live_names) if wanted(live)]
        self.golden_to_live = {g: live for live, g in self.live_to_golden.items()}
        self.replayer = replayer  # replay on golden inputs (spec.replay)
        self.inputs_changed = inputs.changed  # the model's inputs differ from the recording's
        self.inputs_replaced = inputs.replaced  # ... by more than their dtype (env.inputs_replaced)
        self.objects_changed = inputs.objects_changed  # ... in an opaque object replays get live
        # replay="all" may judge a call by its own computation only when every other call is judged
        # too and the model got the recording's inputs: until its first call shows they are
        # (replay_args.root_inputs_match), and for good under a layer selection, outputs keep their verdicts
        self.verify_inputs = inputs.unverified
        self.partial_selection = partial_selection
        self._root_seen = False
        self.input_note = ""
        self._live_output: Any = None  # the output being compared, in a live run (not in diff)
        self.origin: Origin | None = None
        self.unreplayed: dict[tuple[str, int], str] = {}  # replay="all": calls not replayed, and why
        self.parents: dict[tuple[str, int], tuple[int, str | None]] = {}  # replay="all": call -> children, last
        self.hints: dict[tuple[str, int], str] = {}  # replay="all": a failing own error's string-argument hint
        self.described = 0  # diverged calls described so far (DESCRIBED)
        self.describe_first = DESCRIBED  # how many diverged calls get described without being asked
        self._where = None if spec.where is None else Selector(spec.where, None, self.live_to_golden)

    @staticmethod
    def default_filter(meta: Mapping[str, Any], spec: CompareSpec) -> Selection | None:
        """The golden's recorded selection, each pattern also under ``rename`` (for live layers
        that have no golden counterpart), or None when it recorded every layer."""
        inc, exc = recorded_selection(meta)
        if inc is None and exc is None:
            return None
        return renamed_patterns(inc, spec.rename), renamed_patterns(exc, spec.rename)

    # ------------------------------------------------------------------ per call
    def on_enter(self, frame: Frame) -> None:
        if self.spec.replay == "all" and frame.parent is None and not self._root_seen and self.replayer is not None:
            self._root_seen = True  # the model's own call (after its own forward pre-hooks)
            gname = self.live_to_golden.get(frame.name)
            same = root_inputs_match(self.reader, None if gname is None else self.reader.by_key.get((gname, 0)), frame)
            if same is False:
                self.inputs_replaced = self.inputs_changed = True
                self.input_note = ("the model's inputs as its forward received them (after its own forward "
                                   "pre-hooks) differ from the recording's")
            elif same:
                self.verify_inputs = False
        if self.replayer is not None:
            try:
                remember_start(frame)  # in-place changes to its inputs, copies of objects it may mutate
            except UnsupportedTensorError as e:
                raise e.in_layer(frame.name, None, "an input") from None

    def on_output(self, frame: Frame, output: Any) -> None:
        try:
            self._on_output(frame, output)
        except UnsupportedTensorError as e:
            raise e.in_layer(frame.name, frame.call, "an output") from None

    def _on_output(self, frame: Frame, output: Any) -> None:
        tname = type(frame.module).__name__
        self._live_output = output  # (for older goldens' containers held by type only: value_at)
        if self.transform is not None:  # every call, whatever the golden holds (same order on every rank)
            leaves = flatten(output, fields=True)
            self.transform(frame.name, leaves)
            res, entry = self._judge_call(frame.name, frame.call, tname, lambda: leaves)
        else:
            res, entry = self._judge_call(frame.name, frame.call, tname, lambda: flatten(output, fields=True),
                                          single=output if is_plain_tensor(output) else None)
        if res is None:
            return
        if self.replayer is not None and entry is not None:
            # its parent's replay returns the golden's output for it (replay="all": without running it)
            self.replayer.returned(frame, entry, output, stub=self.spec.replay == "all")
            if self.spec.replay == "all":
                own = self.replayer.own(frame, entry, self.compare_leaves)
                if own.layer is None and own.reason is not None:
                    self.unreplayed[(res.name, res.call)] = str(own.reason)
                if own.layer is not None and not own.layer.ok:
                    self.hints[(res.name, res.call)] = string_hint(entry, frame)
                if own.layer is not None and (self.inputs_replaced or self.verify_inputs or self.partial_selection):
                    # the model's inputs changed (or could not be shown unchanged), or code outside the
                    # selected layers went unjudged: "each layer computes what it did" cannot make the
                    # changed outputs a pass; the output verdict stands, the own error is shown (inputs
                    # only cast to another floating dtype are the cross-precision case replay="all" judges)
                    keep_own(res, own.layer)
                elif own.layer is not None:
                    res = judge_by_own(res, own.layer)
                    self.results[-1] = res
                if frame.children:
                    self.parents[(res.name, res.call)] = (frame.children, frame.last_child)
            elif self.origin is None and res.status in REPLAYABLE:
                self.origin = self.replayer.attribute(frame, entry, res, self.compare_leaves, self.inputs_changed,
                                                      self.results)
        if self.spec.fail_fast and not res.ok:
            raise StopForward

    def consume(self, source: LiveSource) -> None:
        """Compare every call a source yields, in its order (a source other than module hooks:
        a recording, an exported graph, a runtime session); ``fail_fast`` stops at the first
        diverging call."""
        try:
            for c in source.calls():
                self.on_leaves(c.name, c.call, c.type_name, c.leaves, c.only)
        except StopForward:
            pass

    def on_leaves(self, name: str, call: int, tname: str, get_leaves: Callable[[], list[Leaf]],
                  only: frozenset[str] | None = None) -> None:
        """Compare one layer call given its flattened outputs (a recording's: :mod:`activation_guard.api.diff`);
        ``only``: the golden outputs it can be judged on (``LiveCall.only``)."""
        res, _ = self._judge_call(name, call, tname, get_leaves, only=only)
        if res is not None and self.spec.fail_fast and not res.ok:
            raise StopForward

    def _judge_call(self, name: str, call: int, tname: str, get_leaves: Callable[[], list[Leaf]],
                    single: Any = None, only: frozenset[str] | None = None
                    ) -> tuple[LayerResult | None, CallEntry | None]:
        """Compare one layer call given its flattened outputs; ``get_leaves`` runs only when the
        golden has this call. None for a call outside the golden's recorded selection. ``single``:
        the output when it is one plain tensor, for the common case settled without leaves."""
        pos = len(self.results)
        # a live name no golden name maps to is new, even if a golden layer had that name
        # before `rename` mapped it elsewhere
        gname = self.live_to_golden.get(name)
        entry = None if gname is None else self.reader.by_key.get((gname, call))
        if entry is None:
            if self.golden_filter is not None and not selected(gname or name, *self.golden_filter):
                return None, None
            known = None if gname is None else self.golden_calls.get(gname)
            detail = (f"the golden has {known} call(s) of this layer; this is call {call}" if known
                      else "this layer is not in the golden (new layer, or renamed: see `rename=`)")
            res = LayerResult(name, call, "unexpected", tname, position=pos, detail=detail)
        else:
            self.seen.add((entry.name, call))
            if only is not None:  # a source that sees some outputs only: the others are not comparable
                if not only:
                    return None, entry
                if len(only) != len(entry.leaves) or any(g.path not in only for g in entry.leaves):
                    entry = dataclasses.replace(entry, leaves=[g for g in entry.leaves if g.path in only])
            type_changed = entry.type_name and entry.type_name != tname
            gname = entry.name if entry.name != name else None
            quick = None
            if single is not None and len(entry.leaves) == 1 and entry.leaves[0].path == "":
                g = entry.leaves[0]
                same = self._same_bytes(g, single, "Tensor", name, entry)
                if same is not None:  # the common case: bit-identical
                    dt = g.dtype or ""
                    tol = None if type_changed else self.judge.identical_tolerance(name, dt)
                    if tol is not None:  # its numbers are built only when a report reads them
                        res = IdenticalCall.made(name, call, tname, pos, entry.position, gname,
                                                 (_identical_row, name, entry.name, call, g.path, dt, g.shape,
                                                  _first(same), tol))
                        self.results.append(res)
                        return res, entry
                    quick = _identical_now(self.judge, name, entry, g, single, same)
            leaves = [quick] if quick is not None else self.compare_leaves(entry, get_leaves(), name, describe=True)
            res = LayerResult.from_leaves(name, call, tname, leaves, position=pos, golden_position=entry.position,
                                          golden_name=gname)
            if type_changed:
                res.golden_type_name = entry.type_name
                if res.ok:
                    res.detail = f"module type changed {entry.type_name} -> {tname} (values still match)"
        self.results.append(res)
        return res, entry

    def replay_origin(self) -> Origin | None:
        """``replay="all"``: the first call in execution order whose own error is out of
        tolerance; a parent there (its children's own errors are within, since they return
        first) changed its own code between them."""
        if self.spec.replay != "all" or self.replayer is None:
            return self.origin
        for r in self.results if not self.objects_changed else ():  # (own errors then blame its readers)
            if r.own_status is not None and r.own_status != "match":
                parent = self.parents.get((r.name, r.call))
                hint = self.hints.get((r.name, r.call), "")
                if parent is not None:  # r: judged by its own error (replay="all")
                    children, last = parent
                    found = self.replayer.parent_origin(r.name, r.call, r.type_name, r,
                                                        self.replayer.between.get((r.name, r.call)), last, children)
                    found.detail += hint
                    return found
                return Origin(r.name, r.call, "layer", r.own_max_abs_diff, type_name=r.type_name,
                              detail="re-run on the golden's own inputs it differs: its own computation changed"
                                     + self.replayer.random_hint(r.name, r.call) + hint)
        first = next((r for r in self.results if not r.ok), None)
        if first is not None and self.inputs_replaced:
            root = next((r for r in self.results if r.name == ""), None)
            return inputs_origin("", "" if root is None else root.type_name, first.name, first.own_max_abs_diff,
                                 replayed=first.own_max_abs_diff is not None)
        why = None if first is None else self.unreplayed.get((first.name, first.call))
        if first is not None and why is not None:  # judged by what it inherited: no replay names an origin
            return Origin(first.name, first.call, "unknown", type_name=first.type_name,
                          detail=f"not replayed: {why}; its output, with what it inherited, differs")
        return None

    def compare_leaves(self, entry: CallEntry, leaves: list[Leaf], name: str,
                       judge: Judge | None = None, *, describe: bool = False) -> list[LeafResult]:
        """One call's live leaves against its golden entry, by ``judge`` (default: this run's); what
        replay calls for a replayed output (:class:`~activation_guard.replay.replay.CompareLeaves`).
        ``describe``: a call of the run itself (not a replay's): a diverged output may get its shape
        of divergence."""
        out = self._compare_leaves(entry, leaves, name, judge, describe)
        if describe and any(r.where is not None for r in out):
            self.described += 1
        return out

    def _wants_where(self, name: str) -> bool | None:
        """Whether a diverged call of ``name`` is described: True when asked for (``where``),
        False among the first ``describe_first`` diverged calls, None for neither."""
        if self._where is not None and self._where(name):
            return True
        return False if self.described < self.describe_first else None

    def _compare_leaves(self, entry: CallEntry, leaves: list[Leaf], name: str, judge: Judge | None,
                        describe: bool) -> list[LeafResult]:
        view = self.reader.live_view(entry, leaves, self._live_output)  # an older golden's paths
        if view is not None and view.conflict is not None:
            return [view.conflict]
        judge = judge or self.judge
        if len(leaves) == 1 and len(entry.leaves) == 1 and leaves[0].path == entry.leaves[0].path:
            only = leaves[0]  # one output, where the golden has it: no path matching to do
            res = self._compare_leaf(entry.leaves[0], only, name, entry, judge, describe)
            if only.dist is not None:  # distributed: name the rank holding the worst element
                attribute(res, only.dist)
            return [res]
        live = {leaf.path: leaf for leaf in leaves} if view is None else view.leaves
        results: list[LeafResult] = []
        gpaths = {g.path for g in entry.leaves}
        for g in entry.leaves:
            lv = live.get(g.path)
            if lv is None and view is not None and g.path in view.settled:
                results.append(view.settled[g.path])
                continue
            if lv is None:
                if not is_fields(g.path):  # a named tuple's field names: compared where both sides have them
                    results.append(LeafResult(g.path, "structure",
                                              f"{out_name(g.path)} ({kind_name(g)}) is missing from the live output"))
                continue
            res = self._compare_leaf(g, lv, name, entry, judge, describe)
            if lv.dist is not None:  # distributed: name the rank holding the worst element
                attribute(res, lv.dist)
            results.append(res)
        for leaf in leaves:
            if view is not None and view.settled and view.inside_settled(leaf.path):
                continue  # inside a container the golden holds by type only
            if leaf.path not in gpaths and not is_fields(leaf.path):  # (older goldens have no field names)
                results.append(LeafResult(leaf.path, "structure",
                                          f"{out_name(leaf.path)} ({leaf.type_name}) is new in the live output"))
        return results

    def _same_bytes(self, g: LeafEntry, t: torch.Tensor, type_name: str, name: str,
                    entry: CallEntry) -> np.ndarray | torch.Tensor | None:
        """The common case first (thousands of tiny layers): a small stored tensor of the same
        shape and dtype, bit-identical to the live one, settled by one memcmp of its stored bytes.
        Returns the live value's numpy view (or the tensor, when it has none) when it is identical,
        None for anything else (the full path decides, reading the bytes again only then)."""
        if not (g.pack is not None and g.kind == "tensor" and g.type_name == type_name and t.is_cpu):
            return None
        arr = numpy_view(t)  # its bytes in logical order, as stored
        if (tuple(t.shape) if arr is None else arr.shape) != g.shape or dtype_name(t) != g.dtype:
            return None
        live = tensor_bytes(t).tobytes() if arr is None else arr.tobytes()
        # bytes against bytes: comparing a memoryview goes element by element (92 us for 64 KiB,
        # against 2 us for the copy and a memcmp)
        if self.reader.packed_bytes(g, lambda: _leaf_label(name, entry.call, g.path)).tobytes() != live:
            return None
        return t if arr is None else arr

    def _identical_small(self, g: LeafEntry, t: torch.Tensor, type_name: str, name: str, entry: CallEntry,
                         judge: Judge) -> LeafResult | None:
        """:meth:`_same_bytes`, then the judge's verdict on the bit-identical value."""
        same = self._same_bytes(g, t, type_name, name, entry)
        return None if same is None else _identical_now(judge, name, entry, g, t, same)

    def _compare_leaf(self, g: LeafEntry, lv: Leaf, name: str, entry: CallEntry, judge: Judge,
                      describe_it: bool = False) -> LeafResult:
        """One golden leaf against the live leaf at its path: the cases every kind shares here, then
        the comparer of the golden leaf's kind (:data:`PAIRS`)."""
        t = lv.tensor
        if lv.kind == "tensor" and t is not None:
            quick = self._identical_small(g, t, lv.type_name, name, entry, judge)
            if quick is not None:
                return quick
        p = g.path
        if "fingerprint" in (g.kind, lv.kind):  # fingerprint_rule decides (no memcmp fast path)
            if self.fingerprints is None:
                self.fingerprints = FingerprintJudge.for_judge(self.judge)
            return self.fingerprints.compare_leaf(self.reader, g, lv, name, entry, self.spec.allow_dtype_change)
        if {g.kind, lv.kind} == {"object", "str"} and g.type_name == lv.type_name and lv.type_name != "str":
            # a golden (or, in diff, a second recording) from before dtypes, devices, enums and bytes
            # were stored by value
            return LeafResult(p, "match", f"{g.type_name} object: compared by type only (re-record to compare "
                                          "its value)", type_name=lv.type_name, type_only=True)
        if g.kind != lv.kind:
            return LeafResult(p, "structure", f"{out_name(p)} was {kind_name(g)}, is now {lv.type_name}")
        return PAIRS.get(g.kind, tensor_pair)(self, g, lv, name, entry, judge, describe_it)

    def golden_tensor(self, g: LeafEntry, label: str, live: torch.Tensor) -> torch.Tensor:
        """A stored tensor leaf's values, read the cheapest way for this run."""
        if g.pack is not None and dtype_name(live) == g.dtype and live.device.type == "cpu":
            # a small stored leaf that is not bit-identical (``_identical_small`` settled those)
            assert g.dtype is not None
            return tensor_from_bytes(self.reader.packed_bytes(g, label).copy(), BY_NAME[g.dtype], g.shape)
        # replay="all" reads a stored output again for replays: through their cache (children.py)
        return (self.replayer.cache if self.replayer is not None and self.spec.replay == "all"
                else self.reader).load(g, label)

    def judge_tensor(self, ctx: LeafContext, g: LeafEntry, live: torch.Tensor, judge: Judge,
                     describe_it: bool) -> LeafResult:
        """A stored tensor judged; a diverged one of a call that is described gets its shape of
        divergence here, where both tensors are in memory."""
        golden = self.golden_tensor(g, ctx.label, live)
        res = judge.judge(ctx, golden, live)
        if describe_it and res.status in ("diverged", "nonfinite"):
            asked = self._wants_where(ctx.name)
            if asked is not None:
                try:
                    res.where = describe(golden, live, res.rtol or 0.0, res.atol or 0.0)
                except (RuntimeError, ValueError, TypeError) as e:  # the verdict stands without its description
                    res.where = Where("unknown", f"not described ({type(e).__name__}: {e})")
                res.where.requested = asked
        return res

    # ------------------------------------------------------------------ end of run
    def notes(self) -> list[str]:
        """The report notes of the rules the comparator added (fingerprints), after the judge's, and
        why ``replay="all"`` kept the output verdicts."""
        out = [] if self.fingerprints is None else self.fingerprints.notes()
        if self.spec.replay == "all":
            if self.partial_selection:
                out.append('replay="all" kept each output\'s own verdict: with a layer selection, code outside '
                           "the selected layers is judged by no layer")
            elif self.verify_inputs:
                out.append('replay="all" kept each output\'s own verdict: the model\'s inputs could not be checked '
                           "against the recording's (its call is not selected, or its inputs were not recorded)")
            if self.input_note:
                out.append(self.input_note)
        return out

    def finish(self) -> tuple[list[LayerResult], dict[int, tuple[float, int]]]:
        """All results: live calls in execution order, then golden calls the live run never made
        (``missing``), each placed where the live run passed its spot in the golden's order.

        Linear in the number of calls (plus a sort): a golden of 16,000 layers compared through
        a wrapper (every call missing) must not take minutes."""
        results = list(self.results)
        order: dict[int, tuple[float, int]] = {}
        missing = [c for c in self.golden_selected if (c.name, c.call) not in self.seen]
        if not missing:  # the common case: nothing to place
            return results, order
        # for "the first live call that the golden ran after golden position p": live calls
        # sorted by golden position, with suffix minima of their live positions
        pairs = sorted((r.golden_position, r.position) for r in results
                       if r.golden_position is not None and r.position is not None)
        gpos = [gp for gp, _ in pairs]
        suffix_min: list[float] = [math.inf] * (len(pairs) + 1)
        for i in range(len(pairs) - 1, -1, -1):
            suffix_min[i] = min(float(pairs[i][1]), suffix_min[i + 1])
        made = Counter(r.name for r in results)
        for c in missing:
            later = suffix_min[bisect.bisect_right(gpos, c.position)]
            at = later - 0.5 if math.isfinite(later) else math.inf
            ran = self.golden_calls.get(c.name, 0)
            live_name = self.golden_to_live.get(c.name, c.name)
            n = made[live_name]
            detail = (f"the live run made {n} call(s) of this layer; the golden has {ran}" if n
                      else "this layer did not run (removed, renamed, or skipped by control flow)")
            lr = LayerResult(live_name, c.call, "missing", c.type_name, golden_position=c.position, detail=detail,
                             golden_name=c.name if c.name != live_name else None)
            order[len(results)] = (at, c.position)
            results.append(lr)
        return results, order


def _leaf_label(name: str, call: int, path: str) -> str:
    return LeafContext(name, name, call, path, "", "").label


def _identical_now(judge: Judge, name: str, entry: CallEntry, g: LeafEntry, t: torch.Tensor,
                   same: np.ndarray | torch.Tensor) -> LeafResult:
    """The judge's verdict on a value :meth:`Comparator._same_bytes` found bit-identical, built now."""
    dt = g.dtype or ""
    return judge.identical(LeafContext(name, entry.name, entry.call, g.path, dt, dt), t,
                           same if isinstance(same, np.ndarray) else None)


def _first(same: np.ndarray | torch.Tensor) -> Any:
    """The first element of a bit-identical value (the worst element a match reports), read when
    the call returns: the live tensor may be changed in place later."""
    if isinstance(same, np.ndarray):
        return same.item(0) if same.size else None
    return same.detach().reshape(-1)[0].item() if same.numel() else None


def _identical_row(name: str, golden_name: str, call: int, path: str, dtype: str, shape: tuple[int, ...], first: Any,
                   tol: Tolerance) -> LeafResult:
    """An IdenticalCall's one leaf, from the plain values its row holds."""
    return identical_leaf(LeafContext(name, golden_name, call, path, dtype, dtype), shape, first, tol)
