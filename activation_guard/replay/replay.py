"""Replay: re-run a live layer on the golden's own inputs, and say where a difference was made.

The first diverging output names where numbers first differ, not why. Re-running that module on
the inputs it received when the golden was recorded separates the two cases:

* its output on the golden's inputs still differs: the layer itself computes differently
  (``kind="layer"``: a changed weight, epsilon, activation, kernel);
* it gives the golden's output back, yet its live inputs differ: the difference was made before
  it, by code of its parent's ``forward`` between its children (``kind="parent-code"``), since
  every module output before the first divergence matched; or by the model's inputs
  (``kind="inputs"``).

``replay="all"`` judges every call by this *own error* instead of its inherited output: the gate
for cross-device and cross-precision runs, where drift accumulates through depth. In calibrated
mode the own error is weighed against the layer's own noise floor: a float64 copy of the module
replayed on the same golden inputs (:class:`~activation_guard.calibration.ownfloor.OwnFloorJudge`).

A replay never changes the live run: hooks stand aside, the RNG is forked (and set to the state
the module started with, for training-mode modules), the module's own buffers start from their
values at the call's start and get their live values back, and objects passed as inputs (caches)
are deep-copied before the module can mutate them (:mod:`activation_guard.replay.callstart` takes those
snapshots).

About 630 lines, over the ~400 we aim for: running a replay (as the capture saw the call, user
hooks included: :func:`call_as_captured`), judging the inputs a parent's code hands its children,
and turning both into an origin are one sequence of decisions over the same call. The snapshot
taken at each call's start (:mod:`.callstart`), the children standing in during a replay
(:mod:`.children`), rebuilding arguments around golden tensors (:mod:`..values.rebuild`) and which golden
tensors a call gets, or why its arguments do not line up (:mod:`.args`), and what an origin
says when a replay's assumptions do not hold (:mod:`.hints`), live in their own modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._core import devices
from .._core.dtypes import dtype_name
from ..calibration.calibrate import CalibratedJudge
from ..calibration.ownfloor import OwnFloorJudge, judge_input
from ..calibration.shadow import float32_random, to_reference
from ..capture.hooks import Frame, HookState, rng_moved, rng_state, set_rng_state
from ..judges.strict import Judge, LeafContext, StrictJudge
from ..options.selection import display_name
from ..results import LayerResult, LeafResult, Origin
from ..store import CallEntry, GoldenReader
from ..values.leaves import Leaf, UnsupportedTensorError, flatten, flatten_inputs
from ..values.rebuild import clone_inputs, rebuild_inputs
from .args import ArgsChanged, golden_inputs
from .callstart import CallStart, modified_in_place, start_values
from .children import (
    ChildCall,
    ChildHooks,
    GoldenCache,
    GoldenOutputs,
    buffers_aside,
    buffers_back,
    restore_buffers,
    saved_buffers,
    skeleton,
)
from .hints import inexact_before, string_hint, unjudged_source


class CompareLeaves(Protocol):
    """How replay asks the comparator to judge a replayed output: the leaves of one call against
    its golden entry, by the given judge (default: the comparator's own)."""

    def __call__(self, entry: CallEntry, leaves: list[Leaf], name: str,
                 judge: Judge | None = None) -> list[LeafResult]: ...


REPLAYABLE = frozenset({"diverged", "nonfinite", "shape", "dtype", "structure"})


@dataclass
class OwnResult:
    """A replay's verdict (``layer``), or why the call could not be replayed (``reason``).
    ``between``: (the child before, the child) when the first difference a parent's own code made
    is in the inputs of one of its children."""

    layer: LayerResult | None
    reason: str | None = None
    between: tuple[str | None, str] | None = None

    @property
    def args_changed(self) -> bool:
        """Not replayed because the call's arguments differ in structure (its caller's doing)."""
        return isinstance(self.reason, ArgsChanged)


class Replayer:
    """Replays live calls on golden inputs during a compare (the comparator calls it)."""

    def __init__(self, reader: GoldenReader, strict: StrictJudge, *, grad: bool = False,
                 calibrated: CalibratedJudge | None = None, reference: torch.nn.Module | None = None):
        """``reference``: the float64 copy of the model (calibrated mode), for own noise floors."""
        self.reader = reader
        self.cache = GoldenCache(reader)
        self.strict = strict
        self.grad = grad
        self.calibrated = calibrated
        self.reference = reference
        self.state: HookState | None = None  # set once the hooks are installed
        self.replayed = 0
        self.failures: dict[str, int] = {}  # why calls could not be replayed -> how many
        self.between: dict[tuple[str, int], tuple[str | None, str]] = {}  # call -> children its code differs between
        self.no_reference: dict[str, int] = {}  # why replays had no float64 reference (own floor) -> how many
        self.drew_random: set[tuple[str, int]] = set()  # replayed calls that drew random numbers
        self.wrote: set[str] = set()  # layers with a call that changed its arguments in place

    def random_hint(self, name: str, call: int) -> str:
        """What a replay of a call that draws random numbers cannot tell apart (for its origin text)."""
        if (name, call) not in self.drew_random:
            return ""
        return ("; it draws random numbers, and its replay starts from the live run's random state: if code "
                "before it drew more or fewer random numbers than when the golden was recorded, that shift alone "
                "would explain this")

    # ------------------------------------------------------------------ running
    def _run(self, module: torch.nn.Module, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any],
             hooks: ChildHooks | None = None, modules: dict[str, torch.nn.Module] | None = None, *,
             widen: bool = False, rewind: Sequence[tuple[str, torch.Tensor]] = ()) -> Any:
        """``rewind``: (name, value) of the module's own buffers to set before it runs (the values
        they had when the live call started); every buffer is restored to its live value after."""
        assert self.state is not None
        mods = _modules(module, hooks.stubbed(modules or {}) if hooks else set())
        saved = saved_buffers([b for m in mods for b in m._buffers.values() if b is not None])
        aside = buffers_aside(mods)  # the rewind and the run write copies: the live tensors keep their versions
        if rewind:
            with torch.no_grad():
                for name, value in rewind:
                    b = module._buffers.get(name)
                    if b is None:
                        continue
                    if b.shape == value.shape:
                        b.copy_(value.to(device=b.device, dtype=b.dtype))
                    else:  # the call assigned a tensor of another shape: the one it started with, as a copy
                        module._buffers[name] = value.to(device=b.device, dtype=b.dtype, copy=True)
        # every CUDA device's generator, not only the current one's: a model on cuda:1 draws from its own
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else []
        self.state.replaying = True
        try:
            with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(self.grad), \
                    (hooks.installed(modules or {}, widen=widen) if hooks is not None else contextlib.nullcontext()):
                if frame.rng is not None:
                    set_rng_state(frame.rng)
                return call_as_captured(module, args, kwargs)
        finally:
            self.state.replaying = False
            buffers_back(aside)
            restore_buffers(saved)

    def own(self, frame: Frame, entry: CallEntry, compare: CompareLeaves) -> OwnResult:
        """The call re-run on the golden's inputs, its children returning the golden's outputs
        (:mod:`activation_guard.replay.children`), and judged against the golden: its output, and the
        inputs its own code gave each child. ``compare(entry, leaves, name, judge)`` is the
        comparator's leaf matching."""
        golden = golden_inputs(self.reader, self.cache, frame, entry)
        if isinstance(golden, str):
            return self._not_replayed(golden)
        start = frame.data if isinstance(frame.data, CallStart) else CallStart([], {})
        held = tensor_holders(frame.args, frame.kwargs)
        if held:
            return self._not_replayed(_holders_text(held))
        if any(v is None for v in start.objects.values()):
            return self._not_replayed("it takes an object that could not be copied when the call started, so a "
                                      "re-run would differ")
        rewind = start_values(start, frame.module)
        if isinstance(rewind, str):
            return self._not_replayed(rewind)
        if frame.rng is not None and rng_moved(frame.rng):
            self.drew_random.add((frame.name, frame.call))  # it returned just now: the state moved in it
        children = start.children
        if any(c.module is frame.module for c in children):
            return self._not_replayed("it calls itself (recursion): a re-run cannot tell its own call from the "
                                      "inner ones")
        stored = next((c for c in children if c.entry.fingerprinted), None)
        if stored is not None:  # its children return the golden's values during its replay: none to return
            return self._not_replayed(f"replay needs full values, but its child {display_name(stored.name)!r} is "
                                      f"stored as a fingerprint")
        outputs = GoldenOutputs(self.cache, children)
        judge: Judge = self.strict
        ref_hooks: ChildHooks | None = None
        try:
            if self.calibrated is not None and self.reference is not None:
                # first, on its own copies: the live replay may change its inputs or append to a cache
                rargs, rkwargs = rebuild_inputs(frame.args, frame.kwargs, golden, objects=start.objects)
                refs, ref_hooks = self._reference_outputs(frame, rargs, rkwargs, children, outputs, rewind)
                judge = OwnFloorJudge(self.calibrated, refs)
            # the live replay is the snapshot's last use: it gets the objects themselves, not copies
            args, kwargs = rebuild_inputs(frame.args, frame.kwargs, golden, objects=start.objects, copy_objects=False)
        except UnsupportedTensorError as e:  # a wrapper subclass input that cannot be rebuilt
            return self._not_replayed(f"its inputs cannot be rebuilt from the golden: {e}")
        hooks = ChildHooks(children, outputs) if children else None
        try:
            out = self._run(frame.module, frame, args, kwargs, hooks, {c.name: c.module for c in children},
                            rewind=rewind)
        except Exception as e:  # a replay never breaks the comparison: the origin says why
            return self._not_replayed(f"re-running it on the golden's inputs raised {type(e).__name__}: {e}")
        leaves: list[LeafResult] = compare(entry, flatten(out, fields=True), frame.name, judge)
        between = None
        if hooks is not None:
            first = self._child_inputs(frame, entry, hooks, ref_hooks)
            if first is not None:
                i, bad = first
                leaves += bad
                between = (children[i - 1].name if i > 0 else None, children[i].name)
                self.between[(frame.name, frame.call)] = between
        self.replayed += 1
        return OwnResult(LayerResult.from_leaves(frame.name, frame.call, type(frame.module).__name__, leaves),
                         between=between)

    def _not_replayed(self, reason: str) -> OwnResult:
        """Why a call was not replayed, counted for the report's notes."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        return OwnResult(None, reason)

    def _reference_outputs(self, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any],
                           children: list[ChildCall], outputs: GoldenOutputs,
                           rewind: Sequence[tuple[str, torch.Tensor]] = ()) -> tuple[dict[str, Any], ChildHooks | None]:
        """The float64 module replayed on the same golden inputs (its children returning the
        golden's outputs, widened): the own noise floor's reference, for its output and for the
        inputs it gives its children."""
        assert self.reference is not None
        try:
            module = self.reference.get_submodule(frame.name) if frame.name else self.reference
            modules = {c.name: self.reference.get_submodule(c.name) for c in children}
        except AttributeError:
            return {}, None
        dev = devices.module_device(module, devices.module_device(self.reference, torch.device("cpu")))
        hooks = ChildHooks(children, outputs) if children else None
        try:
            with float32_random():
                out = self._run(module, frame, to_reference(args, dev), to_reference(kwargs, dev), hooks, modules,
                                widen=True, rewind=rewind)
        except Exception as e:  # no float64 reference: the calibrated rule falls back (the notes say so)
            why = f"its float64 copy raised {type(e).__name__} when re-run"
            self.no_reference[why] = self.no_reference.get(why, 0) + 1
            return {}, None
        return {leaf.path: leaf.tensor for leaf in flatten(out) if leaf.kind == "tensor"}, hooks

    def _child_inputs(self, frame: Frame, entry: CallEntry, hooks: ChildHooks,
                      ref: ChildHooks | None) -> tuple[int, list[LeafResult]] | None:
        """The first child call (index) whose inputs, as the replayed call's own code made them from
        the golden's values, differ from the golden's inputs of that call; and how."""
        for i in sorted(hooks.inputs):
            c = hooks.calls[i]
            if c.entry.inputs is None:
                continue
            golden = {e.path: e for e in c.entry.inputs}
            child = _relative(c.name, frame.name)
            bad: list[LeafResult] = []
            for path, t in hooks.inputs[i].items():
                label = f"input {path} of {child!r}"
                where = f"layer {display_name(c.name)!r} call {c.entry.call} input {path!r}"
                g = golden.get(path)
                target = None if g is None else self.reader.resolve(g, where)
                if target is None or target.kind != "tensor" or target.dtype is None:
                    bad.append(LeafResult(label, "structure", f"{label} is new: the golden has no such tensor input"))
                    continue
                if target.shape != tuple(t.shape):
                    bad.append(LeafResult(label, "shape", f"{label} shape {list(target.shape)} -> {list(t.shape)}",
                                          dtype=target.dtype, shape=target.shape, live_shape=tuple(t.shape)))
                    continue
                gt = devices.golden_on(self.cache.load(target, where), t.device)
                if gt.dtype == t.dtype and torch.equal(gt, t):  # the common case: what its code passed on as is
                    continue
                floor = None
                if g is not None and g.alias is not None and g.alias[2] == "out" and self.calibrated is not None:
                    floor = self.calibrated.golden.get(g.alias[0], g.alias[1], g.alias[3])
                rt = None if ref is None else ref.inputs.get(i, {}).get(path)
                ctx = LeafContext(frame.name, entry.name, entry.call, label, target.dtype, dtype_name(t))
                res = judge_input(self.strict, self.calibrated, ctx, gt, t, rt, floor)
                if res.status != "match":
                    res.detail = (f"{label}, made by its own code from the golden's values, differs from the golden's"
                                  + (f": {res.detail}" if res.detail else ""))
                    bad.append(res)
            for path, e in golden.items():  # a tensor argument the golden's call had, which its code no longer passes
                if path not in hooks.inputs[i] and e.kind in ("tensor", "alias", "fingerprint"):
                    label = f"input {path} of {child!r}"
                    bad.append(LeafResult(label, "structure", f"{label} is missing: the golden's call had it"))
            if bad:
                return i, bad
        return None

    def wrote_hint(self, prev: str | None, parent: str) -> str:
        """For an origin between two children: the one before may have made the difference by
        writing into its arguments, which is no output of its and so never compared."""
        if prev is None or prev not in self.wrote:
            return ""
        p = _relative(prev, parent)
        return (f"; but {p!r} changes its arguments in place, and what it writes is not compared (it is no output "
                f"of {p!r}): the change may be in {p!r} instead")

    # ------------------------------------------------------------------ attribution
    def attribute(self, frame: Frame, entry: CallEntry, res: LayerResult, compare: CompareLeaves,
                  inputs_changed: bool, earlier: Sequence[LayerResult] = ()) -> Origin:
        """Why the first diverging call ``frame`` differs (see the module docstring). ``earlier``:
        the calls judged before it, for the ones that pass on a difference without failing."""
        found = self._attribute(frame, entry, res, compare, inputs_changed)
        if (found.name, found.call) == (frame.name, frame.call) and found.kind in ("layer", "parent-code"):
            found.detail += string_hint(entry, frame)  # its own code, blamed: unless a string it was given changed
        if found.kind in ("parent-code", "unknown") and not inputs_changed:
            # "children compute the same" assumes each child that passed returned the golden's values
            passed_on = unjudged_source(frame, found, earlier)
            if passed_on is not None:
                return passed_on
            grown = inexact_before(frame, found, earlier)
            if grown is not None:
                return grown
        return found

    def _attribute(self, frame: Frame, entry: CallEntry, res: LayerResult, compare: CompareLeaves,
                   inputs_changed: bool) -> Origin:
        tname = type(frame.module).__name__
        own = self.own(frame, entry, compare)
        if own.layer is None and own.args_changed:  # its caller passes other arguments: the caller's code
            if inputs_changed and frame.parent is not None:
                # ... unless the model was called with other inputs, which may be what was passed on
                root = self._root(frame)
                return inputs_origin(root.name, type(root.module).__name__, frame.name, None, replayed=False,
                                     why=f"its arguments changed too ({own.reason}): the inputs may be what was "
                                         f"passed on; check them first")
            return self._args_origin(frame, str(own.reason))
        if own.layer is None:
            return Origin(frame.name, frame.call, "unknown", detail=f"not replayed: {own.reason}", type_name=tname)
        keep_own(res, own.layer)
        err = own.layer.max_abs_diff
        if not own.layer.ok and frame.children:  # a parent whose children all matched: its own code
            return self.parent_origin(frame.name, frame.call, tname, own.layer, own.between, frame.last_child,
                                      frame.children)
        if not own.layer.ok:
            return Origin(frame.name, frame.call, "layer", err, type_name=tname, detail=(
                f"re-run on the golden's own inputs it still differs ({_numbers(own.layer)}): its own "
                f"computation changed" + self.random_hint(frame.name, frame.call)))
        if inputs_changed:
            root = self._root(frame)
            return inputs_origin(root.name, type(root.module).__name__, frame.name, err)
        parent = frame.parent
        differ = self._inputs_differ(frame, entry)
        if parent is None or differ is False:
            why = ("its live inputs equal the golden's, so the live call differed for another reason (randomness, "
                   "state changed during the forward)") if differ is False else "it is the model itself"
            return Origin(frame.name, frame.call, "unknown", err, type_name=tname, detail=(
                f"re-run on the golden's inputs it gives the golden's output; {why}"))
        assert self.state is not None
        node, above = self._above(frame)
        if isinstance(above, str):
            return Origin(frame.name, frame.call, "unknown", err, type_name=tname, detail=(
                f"re-run on the golden's inputs it gives the golden's output, and its inputs differ; {above}"))
        parent = above
        pcall = self.state.calls.get(parent.name, 0)
        child, prev = _relative(node.name, parent.name), node.previous
        between = (f"between {_relative(prev, parent.name)!r} and {child!r}" if prev is not None
                   else f"before {child!r}")
        via = "" if node is frame else f" (and so those of {display_name(frame.name)!r} inside it)"
        return Origin(parent.name, pcall, "parent-code", err, type_name=type(parent.module).__name__, child=node.name,
                      previous=prev, detail=(
                          f"own code {between}: its children compute the same on the golden inputs, but the inputs of "
                          f"{child!r} differ{via}" + self.wrote_hint(prev, parent.name)))

    def _above(self, frame: Frame) -> tuple[Frame, Frame | str]:
        """Whose code made the inputs of ``frame`` differ, which re-run on the golden's inputs gives
        the golden's output: its parent's, unless it is its parent's first child and the parent's
        own inputs differ too; then the change is above, and the walk goes on up. Returns the call
        whose inputs the code made and the caller whose code it is, or why that cannot be told."""
        assert self.state is not None
        node = frame
        while True:
            parent = node.parent
            assert parent is not None
            if node.previous is not None or parent.parent is None:
                return node, parent  # a sibling before it matched, or the model's own code
            pentry = self.reader.by_key.get((parent.name, self.state.calls.get(parent.name, 0)))
            differ = None if pentry is None else self._inputs_differ(parent, pentry)
            if differ is False:
                return node, parent  # its parent got the golden's inputs: its code before its first child
            if differ is None:
                held = tensor_holders(parent.args, parent.kwargs)
                why = _holders_text(held) if held else "not recorded, or changed in place"
                return node, (f"it is the first child of {display_name(parent.name)!r}, whose own inputs could not "
                              f"be checked against the golden's ({why}), so the change may be in "
                              f"{display_name(parent.name)!r}'s code before it or anywhere above")
            node = parent

    def parent_origin(self, name: str, call: int, tname: str, own: LayerResult, between: tuple[str | None, str] | None,
                      last_child: str | None, children: int) -> Origin:
        """A call with children whose replay differs (its children returning the golden's outputs):
        its own code changed, between the two children ``between`` names, or after its last child."""
        if between is not None:
            prev, child = between
            where = (f"between {_relative(prev, name)!r} and {_relative(child, name)!r}" if prev is not None
                     else f"before {_relative(child, name)!r}")
            return Origin(name, call, "parent-code", own.max_abs_diff, type_name=tname, child=child, previous=prev,
                          detail=(f"own code {where}: re-run on the golden's inputs, its children returning the "
                                  f"golden's outputs, the inputs of {_relative(child, name)!r} differ "
                                  f"({_how(own)})" + self.wrote_hint(prev, name)))
        return Origin(name, call, "parent-code", own.max_abs_diff, type_name=tname, previous=last_child,
                      detail=(f"own code: its {children} child call(s) computed what they computed before, "
                              f"but re-run on the golden's own inputs its output still differs ({_numbers(own)})"
                              + self.random_hint(name, call)))

    def _args_origin(self, frame: Frame, reason: str) -> Origin:
        """The first diverging call was called with arguments of another structure than the golden's
        call: made by its parent's code (or, for the model itself, by whoever calls it)."""
        parent = frame.parent
        if parent is None:
            return Origin(frame.name, frame.call, "inputs", type_name=type(frame.module).__name__,
                          detail=f"the model is called with other arguments than when the golden was recorded: "
                                 f"{reason}")
        assert self.state is not None
        child, prev = _relative(frame.name, parent.name), frame.previous
        between = (f"between {_relative(prev, parent.name)!r} and {child!r}" if prev is not None
                   else f"before {child!r}")
        return Origin(parent.name, self.state.calls.get(parent.name, 0), "parent-code",
                      type_name=type(parent.module).__name__, child=frame.name, previous=prev,
                      detail=f"own code {between}: the arguments it passes to {child!r} changed: {reason}")

    @staticmethod
    def _root(frame: Frame) -> Frame:
        while frame.parent is not None:
            frame = frame.parent
        return frame

    def _inputs_differ(self, frame: Frame, entry: CallEntry) -> bool | None:
        """Whether the live call's tensor inputs differ from the golden's beyond tolerance (None:
        cannot tell: the golden has no inputs, or the layer changed its inputs in place)."""
        if entry.inputs is None or modified_in_place(frame) or tensor_holders(frame.args, frame.kwargs):
            return None
        golden = {e.path: e for e in entry.inputs}
        for lv in flatten_inputs(frame.args, frame.kwargs):
            if lv.kind != "tensor" or lv.tensor is None:
                continue
            g = golden.get(lv.path)
            if g is None:
                return True
            g = self.reader.resolve(g)
            if g.kind != "tensor" or g.shape != tuple(lv.tensor.shape) or g.dtype is None:
                return True
            t = self.reader.load(g, f"layer {display_name(entry.name)!r} call {entry.call} input {lv.path!r}")
            ctx = LeafContext(frame.name, entry.name, entry.call, lv.path, g.dtype, g.dtype)
            if self.strict.judge(ctx, t, lv.tensor.to(t.dtype)).status != "match":
                return True
        return False

    def returned(self, frame: Frame, entry: CallEntry, output: Any = None, *, stub: bool = False) -> None:
        """A compared call returned: its parent's replay will have it return the golden's output
        (``stub``: without running it, from the skeleton of ``output``)."""
        parent = frame.parent
        if parent is not None and isinstance(parent.data, CallStart):
            end = None
            if stub and (frame.rng is not None or parent.rng is not None):
                # where it left the random stream (an eval-mode child may hold a training Dropout;
                # a GPU one moves only the CUDA generator): its stub puts the stream there
                end = rng_state()
            # a child that wrote into its arguments runs in its parent's replay (a stub would not
            # write, and the parent's next child would see other inputs: a false alarm)
            wrote = modified_in_place(frame)
            if wrote:
                self.wrote.add(frame.name)
            aliased = stub and (_shares_memory(frame, output) or wrote)
            parent.data.children.append(ChildCall(frame.module, frame.name, entry,
                                                  skeleton(output) if stub and not aliased else None, end, aliased))

    def notes(self) -> list[str]:
        out = [f"{n} layer call(s) not replayed: {why}" for why, n in self.failures.items()]
        out += [f"{n} replayed call(s) had no own noise floor ({why}): judged with the golden's floors, or strictly"
                for why, n in self.no_reference.items()]
        return out


def call_as_captured(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)`` as the capture saw the call. The capture records a call's inputs
    after the module's own forward pre-hooks ran and its output before its own forward hooks run
    (capture.py), so the pre-hooks run (a pruning mask, an offload hook may be needed) on copies of
    the given (recorded) inputs, then a last pre-hook hands the forward the given inputs themselves;
    the output is taken before the module's forward hooks rewrite it. Only the outermost
    call is steered: a module that calls itself keeps its inner calls' own arguments."""
    outputs: list[Any] = []
    entered = [False]
    if any(not getattr(h, "_ag_capture", False) for h in module._forward_pre_hooks.values()) or \
            torch.nn.modules.module._global_forward_pre_hooks:
        # the pre-hooks get copies: one that changes its input in place must not change the recorded ones
        call_args, call_kwargs = clone_inputs(args), clone_inputs(kwargs)
    else:
        call_args, call_kwargs = args, kwargs

    def pre(mod: torch.nn.Module, a: Any, kw: Any) -> Any:
        if entered[0]:
            return None
        entered[0] = True
        return args, kwargs

    def post(mod: torch.nn.Module, a: Any, kw: Any, out: Any) -> None:
        outputs.append(out)

    h_pre = module.register_forward_pre_hook(pre, with_kwargs=True)
    h_post = module.register_forward_hook(post, with_kwargs=True, prepend=True)
    try:
        module(*call_args, **call_kwargs)
    finally:
        h_pre.remove()
        h_post.remove()
    return outputs[-1]  # the outermost call returns last


def inputs_origin(root: str, root_type: str, first: str, own_error: float | None, *, replayed: bool = True,
                  why: str = "so the inputs are the first change known") -> Origin:
    """The model's inputs differ from the recording, and the first diverging call ``first`` gives
    the golden's output on the golden's inputs (``replayed``), or was not re-run at all (``why``)."""
    if not replayed:  # its arguments changed, or it could not be re-run
        return Origin(root, 0, "inputs", None, type_name=root_type, detail=(
            f"the model's inputs differ from the recording; the first diverging layer, {display_name(first)!r}, "
            f"was not re-run on the golden's inputs, {why}"))
    return Origin(root, 0, "inputs", own_error, type_name=root_type, detail=(
        f"the model's inputs differ from the recording: the first diverging layer, {display_name(first)!r}, "
        f"gives the golden's output when re-run on the golden's inputs"))


def keep_own(res: LayerResult, own: LayerResult) -> None:
    """Put a replay's verdict on the call's result (the report shows both)."""
    res.own_status = own.status
    res.own_max_abs_diff = own.max_abs_diff
    res.own_max_rel_diff = own.max_rel_diff
    res.own_energy = own.energy


def judge_by_own(res: LayerResult, own: LayerResult) -> LayerResult:
    """``replay="all"``: the call's verdict becomes its own error; the output verdict is kept as
    ``inherited_*``."""
    new = LayerResult.from_leaves(res.name, res.call, res.type_name, own.leaves, position=res.position,
                                  golden_position=res.golden_position, golden_name=res.golden_name)
    keep_own(new, own)
    new.inherited_status = res.status
    new.inherited_max_abs_diff = res.max_abs_diff
    new.inherited_energy = res.energy
    return new


def _how(layer: LayerResult) -> str:
    """How a replay's inputs differ: a changed structure in words, else the numbers."""
    moved = next((leaf.detail for leaf in layer.leaves if leaf.status in ("structure", "shape")), None)
    return moved or _numbers(layer)


def _numbers(layer: LayerResult) -> str:
    if layer.max_abs_diff is None or (not layer.max_abs_diff and layer.detail):
        return layer.detail or layer.status  # no number to give (a string, a type, a structure changed)
    return f"max abs diff {layer.max_abs_diff:.3g}" + (f", rtol={layer.rtol:g}, atol={layer.atol:g}"
                                                      if layer.rtol is not None and layer.atol is not None else "")


def _modules(module: torch.nn.Module, skip: set[int]) -> list[torch.nn.Module]:
    """The modules whose buffers a replay of ``module`` may change: its subtree but the children
    whose forward will not run (``skip``: their ids) and theirs; such a child itself still counts
    when it has hooks of its own, which do run (an old-style spectral norm's power iteration)."""
    out = [module]
    stack = list(module.children())
    while stack:
        m = stack.pop()
        if id(m) not in skip:
            out.append(m)
            stack.extend(m.children())
        elif _own_hooks(m):
            out.append(m)
    return out


def _own_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` has forward (pre-)hooks other than the capture's, or any global pre-hook runs."""
    return bool(torch.nn.modules.module._global_forward_pre_hooks) or any(
        getattr(h, "_ag_token", None) is None for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))


def tensor_holders(args: Any, kwargs: Any) -> list[tuple[str, str]]:
    """Arguments that are plain objects holding tensors (an instance of a class with no methods of
    its own, ``Box(h)``): a golden stores them by type only, so a replay would pass the live
    object, live tensors inside, and judge its own output on the live values. (path, type name)."""
    out = []
    for key, v in [*((f"args/{i}", a) for i, a in enumerate(args)), *((f"kwargs/{k}", a) for k, a in kwargs.items())]:
        if _plain_holder(v):
            out.append((key, type(v).__name__))
    return out


def _plain_holder(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, torch.nn.Module, type)) or not hasattr(v, "__dict__"):
        return False
    cls = type(v)
    if any(callable(f) and not (k.startswith("__") and k.endswith("__"))
           for c in cls.__mro__[:-1] for k, f in vars(c).items()):
        return False  # a class with methods (a cache that appends): copied at the call's start, replayed as is
    return any(isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor)
                                                                                    for y in x))
               for x in vars(v).values())


def _holders_text(held: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{p} ({t})" for p, t in held[:3])
    return (f"its argument(s) {shown} hold tensors inside a plain object, which the golden stores by type only: a "
            f"re-run would use the live tensors, so it cannot be replayed on the golden's")


def _relative(name: str | None, parent: str) -> str:
    if name is None:
        return "?"
    return name[len(parent) + 1:] if parent and name.startswith(parent + ".") else display_name(name)


def _shares_memory(frame: Frame, output: Any) -> bool:
    """Whether a call's output shares storage with one of its inputs (``replay="all"`` only)."""
    try:
        ins = {t.untyped_storage().data_ptr() for t in _plain_tensors(flatten_inputs(frame.args, frame.kwargs))}
        ins.discard(0)
        return bool(ins) and any(t.untyped_storage().data_ptr() in ins for t in _plain_tensors(flatten(output)))
    except (RuntimeError, NotImplementedError, UnsupportedTensorError):  # no storage (a subclass, meta)
        return False


def _plain_tensors(leaves: Any) -> list[torch.Tensor]:
    """Plain tensors the model passed (:attr:`Leaf.passed_tensor`: a number in and the same number
    out would otherwise look like shared memory)."""
    return [t for leaf in leaves if type(t := leaf.passed_tensor) is torch.Tensor]
