"""The float64 shadow forward: the reference a run's noise floor is measured against.

The model is deep-copied to float64 (on the CPU when the live device has no float64), its
parameters widened per module call where the model allows it (:mod:`.widen`, else a whole float64
copy), and run once on the same inputs with full-precision float32 switches and autocast off, with
every RNG isolated so the real forward sees exactly the random numbers it would have seen. Its
outputs are kept by :mod:`.scratch` (in memory within what a whole copy would have held, else in a
private file); its gradients, when a backward runs, go to a temporary golden.

Over the ~400 lines we aim for: the float64 copy's forward, its backward, and the leaf checks that
find a copy computing another function (an epsilon from the dtype) share the copy's state.
"""

from __future__ import annotations

import copy
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .._core.devices import reference_device
from .._core.dtypes import dtype_name
from .._core.errors import ActivationGuardError
from .._core.numerics import full_fp32_precision
from ..capture.hooks import Frame, hooked, rng_state, run_forward, set_rng_state
from ..gradients.hooks import GradCapture
from ..gradients.loss import LossRule
from ..gradients.store import GradRecorder
from ..store import GoldenReader, GoldenWriter
from ..store.floors import CALIBRATED_DTYPES, FloorTable, NoiseFloor, diff_stats
from ..values.leaves import Leaf, flatten
from ..values.rebuild import clone_inputs, map_tensors
from .scratch import Scratch
from .widen import LazyFloat64, check_call, lazy_float64_copy

# --------------------------------------------------------------------------- shadow forward


def to_reference(obj: Any, device: torch.device) -> Any:
    """Inputs for the shadow: floating tensors become float64 copies on ``device``; other
    tensors are copied (the model may modify its inputs in place); containers are rebuilt."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_floating_point():
            return t.to(device=device, dtype=torch.float64, copy=True)
        return t.to(device=device, copy=True)

    return map_tensors(obj, convert)


@contextmanager
def isolated_rng(device: torch.device) -> Iterator[None]:
    """Every generator (torch on the CPU and on ``device``, Python's, numpy's) as it was on entry
    when the block ends: a shadow forward or a diagnostic run must not advance what the real
    forward will draw."""
    py, npst = random.getstate(), np.random.get_state()
    devices = ([device.index if device.index is not None else torch.cuda.current_device()]
               if device.type == "cuda" else [])
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)


@contextmanager
def _no_autocast() -> Iterator[None]:
    with ExitStack() as stack:
        for dev_type in ("cpu", "cuda"):
            if dev_type == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device_type=dev_type, enabled=False))
        yield


class float32_random(TorchFunctionMode):
    """Within a float64 shadow or replay, random numbers are drawn in float32 and widened: the very
    numbers the float32 run draws from the same generator state. Drawn in float64 they differ
    (``torch.rand`` maps the generator's bits to another value per dtype; ``torch.bernoulli`` of a
    float64 probability draws differently), so a drop-path mask would differ and the noise floor
    would measure the mask, not the rounding. Dropout's own draws do not depend on the dtype."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        check_call(func, args, kwargs)
        f64 = torch.float64
        wide = _keep_float64(func, args, kwargs)
        if wide is not None:
            args, kwargs = wide
            if func is torch.Tensor.float:
                return args[0]
        if func in (torch.rand, torch.randn) and kwargs.get("dtype") == f64:
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(f64)
        if func is torch.normal and "out" not in kwargs and (kwargs.get("dtype") == f64 or any(
                isinstance(a, torch.Tensor) and a.dtype == f64 for a in (*args, *kwargs.values()))):
            # mean and std in float32 (as the float32 run has them), the draw widened
            narrow = [a.float() if isinstance(a, torch.Tensor) and a.dtype == f64 else a for a in args]
            kw: dict[str, Any] = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == f64 else v)
                                  for k, v in kwargs.items()}
            if kw.get("dtype") == f64:
                kw["dtype"] = torch.float32
            return func(*narrow, **kw).to(f64)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None or (kwargs.get("dtype") or first.dtype) != f64:
            return func(*args, **kwargs)
        if func in (torch.rand_like, torch.randn_like):
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(f64)
        if func in (torch.bernoulli, torch.Tensor.bernoulli) and len(args) == 1 and set(kwargs) <= {"generator"}:
            return func(first.float(), **kwargs).to(f64)
        if func is torch.Tensor.bernoulli_ and len(args) <= 2 and set(kwargs) <= {"p", "generator"}:
            # x.bernoulli_(probs): a float64 tensor of probabilities draws another mask than float32
            p = args[1] if len(args) == 2 else kwargs.pop("p", 0.5)
            p = p.float() if isinstance(p, torch.Tensor) and p.dtype == f64 else p
            drawn = torch.empty_like(first, dtype=torch.float32).bernoulli_(p, **kwargs)
            with torch.no_grad():
                return first.copy_(drawn)
        if func in (torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.log_normal_,
                    torch.Tensor.cauchy_, torch.Tensor.geometric_):
            drawn = func(torch.empty_like(first, dtype=torch.float32), *args[1:], **kwargs)
            with torch.no_grad():
                return first.copy_(drawn)
        return func(*args, **kwargs)


_CASTS = (torch.Tensor.to, torch.Tensor.type)
_NARROW: list[bool] = []  # not empty while a leaf check runs the model's own dtype: casts are casts there


@contextmanager
def _narrow() -> Iterator[None]:
    _NARROW.append(True)
    try:
        yield
    finally:
        _NARROW.pop()


def _keep_float64(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                                    dict[str, Any]] | None:
    """An explicit cast to float32 of a float64 tensor (``x.float()``, ``x.to(torch.float32)``,
    ``x.type(torch.float32)``), or an op told ``dtype=torch.float32`` on float64 tensors
    (``softmax(x, -1, dtype=torch.float32)``), as float64 keeps it: in the float32 model these
    are no-ops or the precision the model already has, and in the float64 copy a float32 tensor
    meeting float64 weights in a matmul raised. The arguments to call with, or None."""
    if _NARROW:
        return None
    f32, f64 = torch.float32, torch.float64
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func is torch.Tensor.float:
        return (args, kwargs) if first is not None and first.dtype == f64 else None
    if func in _CASTS:
        if first is None or first.dtype != f64:
            return None
        if not any(a is f32 for a in args[1:]) and kwargs.get("dtype") is not f32:
            return None
        new = tuple(f64 if a is f32 else a for a in args)
        return new, ({**kwargs, "dtype": f64} if kwargs.get("dtype") is f32 else kwargs)
    if kwargs.get("dtype") is f32 and any(isinstance(a, torch.Tensor) and a.dtype == f64 for a in args):
        return args, {**kwargs, "dtype": f64}
    return None


def _fails_as_is(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> bool:
    """Whether a copy of the model, in its own dtype, raises on copies of the inputs (asked only
    after its float64 copy raised: which of the two errors to show). The model is left untouched."""
    try:
        probe = copy.deepcopy(model)
    except Exception:
        return False
    try:
        with torch.no_grad(), isolated_rng(device):
            probe(*clone_inputs(args), **clone_inputs(kwargs))
    except Exception:
        return True
    return False


# a leaf's float64 copy may depart from the same leaf run in the model's dtype on the same
# (rounded) inputs by its rounding: one layer of float32 stays far under 0.1% of its output's RMS,
# one of float16/bfloat16 under 5%. More than that is another function (an epsilon taken from
# ``torch.finfo(x.dtype)``, a branch on the dtype), and its float64 output must not be the
# reference of every later layer: their floors would measure the other function, not rounding
SEMANTICS_LIMIT = {torch.float16: 0.05, torch.bfloat16: 0.05}
SEMANTICS_LIMIT_DEFAULT = 1e-3


def _first_float(obj: Any) -> torch.dtype | None:
    for t in torch.utils._pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            return t.dtype
    return None


def _run_dtypes(model: torch.nn.Module, args: Any, kwargs: Any) -> dict[str, torch.dtype]:
    """The dtype each leaf module computes in, in the model as it is: its own floating parameters'
    or buffers', else the model's inputs', else the model's first floating parameter's."""
    default = (_first_float((args, kwargs)) or _first_float(list(model.parameters()))
               or _first_float(list(model.buffers())) or torch.float32)
    out = {}
    for name, mod in model.named_modules():
        own = _first_float([*mod.parameters(recurse=False), *mod.buffers(recurse=False)])
        out[name] = own or default
    return out


# torch.nn's own leaf modules whose forward is one functional call that never branches on the
# dtype (their epsilons and thresholds are fixed numbers, not ``torch.finfo(dtype)``): their float64
# copy computes the very function they compute in the model's dtype, so running them again in that
# dtype could only measure rounding, which is what the noise floors measure anyway. They do nearly
# all of a model's arithmetic, so the check's extra run (about one forward in the model's dtype)
# shrinks to the model's own code. A subclass, a forward replaced on the class, a parametrized
# weight or a training-mode Dropout is checked as any other leaf; so is ``nn.RMSNorm``, whose
# default epsilon is ``torch.finfo(x.dtype).eps``. (A forward replaced on the instance is never
# checked, in this list or not: LeafChecks.install leaves such leaves alone.)
_SAME_IN_EVERY_DTYPE: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear, torch.nn.Bilinear, torch.nn.Embedding, torch.nn.EmbeddingBag,
    torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
    torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
    torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
    torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Identity,
    torch.nn.Dropout,
)
_OWN_FORWARD = {cls: cls.forward for cls in _SAME_IN_EVERY_DTYPE}


def same_in_every_dtype(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` is one of torch.nn's own leaves whose function does not depend on the dtype,
    as torch defines it: its exact class, torch's own forward, plain parameters and buffers."""
    cls = type(mod)
    fwd = _OWN_FORWARD.get(cls)
    if fwd is None or cls.forward is not fwd or not getattr(fwd, "__module__", "").startswith("torch.nn.modules."):
        return False
    if "forward" in mod.__dict__:
        return False
    if cls is torch.nn.Dropout and mod.training and getattr(mod, "p", 1.0) > 0:
        # its mask comes from the generator: one stream per dtype is not promised (a device's
        # kernel may draw per vector of elements), and a different mask is another function
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
               for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None)


class LeafChecks:
    """Every leaf module of the float64 copy, checked call by call against itself run in the
    model's own dtype on its inputs rounded to that dtype. A call that departs by more than
    rounding explains is listed in ``differs`` and returns its low-precision result (widened, the
    float64 gradient kept) to what follows, so later layers' floors measure rounding, not the other
    function. Its own floor then lacks its own rounding (a limit: docs/cross-device.md)."""

    def __init__(self, differs: list[tuple[str, int, float]]):
        self.differs = differs
        self.recording = True
        self.calls: dict[str, int] = {}

    def install(self, shadow: torch.nn.Module, dtypes: dict[str, torch.dtype],
                model: torch.nn.Module | None = None, lazy: LazyFloat64 | None = None) -> None:
        """``model``: the model ``shadow`` was copied from, whose parameters the checks read in
        place of converting the copy's back (:class:`_Narrowed`); ``lazy``: the copy's parameters
        widened per call, from those same parameters."""
        originals = {} if model is None else dict(model.named_modules())
        for name, mod in shadow.named_modules():
            if next(iter(mod.children()), None) is not None or "forward" in mod.__dict__:
                continue
            if same_in_every_dtype(mod):
                continue
            dt = dtypes.get(name, torch.float32)
            if dt == torch.float64:
                continue
            narrowed = _Narrowed(mod, originals.get(name), dt, lazy)
            mod.forward = self._wrap(name, mod, mod.forward, dt, narrowed)  # type: ignore[method-assign]

    def _wrap(self, name: str, mod: torch.nn.Module, orig: Any, dt: torch.dtype, narrowed: _Narrowed) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            # the check's own work runs outside the float64 copy's torch-function mode: in the
            # model's dtype that mode changes nothing, and its Python hook on every op tripled the
            # cost of a calibrated record of a small model
            with _narrow(), torch._C.DisableTorchFunction():
                low_in = map_tensors((args, kwargs), lambda t: t.detach().to(dt) if t.dtype == torch.float64 else t)
            before = rng_state()
            out = orig(*args, **kwargs)
            call = self.calls.get(name, 0)
            if self.recording:
                self.calls[name] = call + 1
            after = rng_state()
            set_rng_state(before)
            try:
                with _narrow(), torch._C.DisableTorchFunction():
                    low = _run_low(mod, orig, low_in, dt, narrowed if self.recording else None)
            except Exception:  # the leaf does not run in that dtype here: nothing to check against
                low = None
            finally:
                set_rng_state(after)
            if low is None:
                return out
            with torch._C.DisableTorchFunction():
                ratio, swapped = _departure(out, low, dt)
            if ratio is None:
                return out
            if self.recording:
                self.differs.append((name, call, ratio))
            return swapped
        return checked


class _Narrowed:
    """A leaf's float64 parameters as the model's own ``dt`` tensors, where those hold exactly
    what converting back would give: the float64 copy was made from them (``x.double().to(dt)``
    is ``x`` for every float32, float16 and bfloat16 value) and neither side has changed since
    (the same tensor objects, version counters and storage). Converting 271M parameters back
    per shadow forward cost about a float32 forward's time; reading the originals costs nothing."""

    __slots__ = ("lazy", "mod", "same")

    def __init__(self, mod: torch.nn.Module, original: torch.nn.Module | None, dt: torch.dtype,
                 lazy: LazyFloat64 | None = None):
        self.same: dict[str, tuple[torch.Tensor, int, int, torch.Tensor, int, torch.Tensor]] = {}
        self.mod = mod
        self.lazy = lazy  # a parameter widened per call holds the original's values while unchanged
        if original is None:
            return
        for k, v in mod._parameters.items():
            o = original._parameters.get(k)
            if (v is None or o is None or v.dtype != torch.float64 or o.dtype != dt or o.shape != v.shape
                    or o.device != v.device or type(o) is not type(v) or o.layout != torch.strided):
                continue
            # v.detach() keeps v's first storage alive: a `.data =` rebinding then always shows as
            # another address (freed, its address could come back for the new data and pass)
            self.same[k] = (v, v._version, v.data_ptr(), o, o._version, v.detach())

    def get(self, k: str, v: torch.Tensor) -> torch.Tensor | None:
        kept = self.same.get(k)
        if kept is None:
            return None
        sv, sver, sptr, o, over, _ = kept
        if self.lazy is not None and sv is not v and self.lazy.widened(self.mod, k, v) and o._version == over:
            return o.detach()
        if sv is not v or v._version != sver or v.data_ptr() != sptr or o._version != over:
            return None
        return o.detach()  # shares o's version counter: an in-place change shows (restored in _run_low)


def _run_low(mod: torch.nn.Module, orig: Any, low_in: Any, dt: torch.dtype, narrowed: _Narrowed | None = None) -> Any:
    """``orig`` run with the module's float64 parameters and buffers as ``dt`` copies (its own are
    untouched: running statistics a training-mode forward updates stay the float64 run's).
    ``narrowed``: parameters taken from the original model instead of converted (buffers, which a
    forward may update, are always copies); one the run changed in place is restored."""
    saved: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
    shared: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    stores: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)
    for store in stores:
        for k, v in store.items():
            if v is not None and v.dtype == torch.float64:
                saved[(id(store), k)] = (store, k, v)
                o = narrowed.get(k, v) if narrowed is not None and store is mod._parameters else None
                if o is not None:
                    shared.append((o, v, o._version))
                store[k] = v.detach().to(dt) if o is None else o
    try:
        with torch.no_grad():
            a, kw = low_in
            return orig(*a, **kw)
    finally:
        for store, k, v in saved.values():
            store[k] = v
        for o, v, ver in shared:
            if o._version != ver:  # the leaf wrote into its parameter: the model's own value back
                with torch.no_grad():
                    o.copy_(v.detach().to(o.dtype))


def _departure(out: Any, low: Any, dt: torch.dtype) -> tuple[float | None, Any]:
    """How far the low-precision run is from the float64 one (the largest share of an output's RMS)
    when that is more than rounding, and the output with the low-precision values in its place."""
    flat, spec = torch.utils._pytree.tree_flatten(out)
    lflat, lspec = torch.utils._pytree.tree_flatten(low)
    if spec != lspec:
        return None, out
    limit = SEMANTICS_LIMIT.get(dt, SEMANTICS_LIMIT_DEFAULT)
    worst: float | None = None
    pairs = []
    for o, lo in zip(flat, lflat):
        if (not isinstance(o, torch.Tensor) or not isinstance(lo, torch.Tensor) or o.dtype != torch.float64
                or not lo.is_floating_point() or o.shape != lo.shape):
            continue
        pairs.append((o, lo))
        if o.numel() == 0:
            continue
        od = o.detach()
        # a cheaper bound first (two norms, one difference in place): rounding sits orders of
        # magnitude under the limit, so almost every output is cleared by it with a wide margin,
        # and the few near or over the limit take the exact figures below (the ones reported)
        diff = torch.linalg.vector_norm(lo.to(torch.float64, copy=True).sub_(od))
        quick, qscale = torch.stack([diff, torch.linalg.vector_norm(od)]).tolist()
        if math.isfinite(quick) and math.isfinite(qscale) and quick <= 0.5 * limit * qscale:
            continue
        rms, scale = torch.stack([(lo.to(torch.float64) - od).square().mean().sqrt(),
                                  od.square().mean().sqrt()]).tolist()
        if not (math.isfinite(rms) and math.isfinite(scale)):
            continue
        if rms > limit * scale:
            share = rms / scale if scale > 0 else math.inf
            worst = share if worst is None else max(worst, share)
    if worst is None:
        return None, out
    swap = {id(o): o + (lo.to(o.dtype) - o).detach() for o, lo in pairs}
    return worst, torch.utils._pytree.tree_unflatten([swap.get(id(x), x) for x in flat], spec)


def _float64_copy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``copy.deepcopy(model)`` whose plain floating parameters on ``device`` are made float64
    as they are copied, as ``.double()`` of the copy makes them (the same values, strides and
    ``requires_grad``): a float32 clone of every parameter first cost a model's worth of memory
    and a pass over it. Parameter subclasses, buffers and the rest are deep-copied as they are."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if (type(p) is torch.nn.Parameter and p.is_floating_point() and p.dtype != torch.float64
                and p.device == device and p.layout == torch.strided):
            memo[id(p)] = torch.nn.Parameter(p.detach().to(torch.float64), p.requires_grad)
    return copy.deepcopy(model, memo)


def held_budget(lazy: LazyFloat64 | None, device: torch.device) -> Callable[[], int] | None:
    """How many bytes of the shadow's outputs :class:`.scratch.Scratch` may keep in memory (copies on
    the CPU): what the whole copy would have held beyond the per-call copy's buffers, where that is
    host memory too; on an accelerator the whole copy's memory was the device's, so None (all to
    the scratch file, as with a whole copy)."""
    if lazy is None or device.type != "cpu":
        return None
    return lambda: lazy.nbytes - lazy.pool.nbytes


class ShadowRun:
    """The float64 copy of a model, run once on the inputs; its outputs kept for the floors (in
    memory within what a whole float64 copy would have held, the rest in a private scratch file)."""

    widen_per_call = True  # False: always a whole float64 copy (tests compare the two)

    def __init__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 include: Sequence[str] | None, exclude: Sequence[str] | None, live_device: torch.device,
                 *, grad: bool = False, keep_model: bool = False, backward: LossRule | None = None):
        """``keep_model``: keep the float64 copy (``model``) for replays' own noise floors.
        ``backward``: also run the backward with this loss and keep the float64 gradients."""
        self.live_device = live_device
        self.grad = grad
        self.backward = backward
        self.keep_model = keep_model
        self.model: torch.nn.Module | None = None
        self.device = reference_device(live_device)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None  # the gradients' golden, with a backward
        self.scratch: Scratch | None = None  # the forward's float64 outputs
        self.lazy: LazyFloat64 | None = None  # the copy's parameters, when widened per call
        self.reader: GoldenReader | None = None  # the float64 gradients
        # leaf calls whose float64 copy computes another function than the model's dtype does:
        # (layer, call, departure as a share of the output's RMS)
        self.differs: list[tuple[str, int, float]] = []
        try:
            self._run(model, args, kwargs, include, exclude)
        except BaseException:
            self.close()
            raise

    def _run(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             include: Sequence[str] | None, exclude: Sequence[str] | None) -> None:
        # without gradients, on the model's own device, the copy's parameters are widened per
        # module call (:mod:`.widen`); a model that uses a parameter outside its module's call
        # trips that, and it all runs again with a whole float64 copy
        if self.widen_per_call and not self.grad and self.backward is None and self.device == self.live_device:
            try:
                self._attempt(model, args, kwargs, include, exclude, lazy=True)
                if self.lazy is not None and self.lazy.tripped is None:
                    return
            except Exception:  # the whole copy's run says whether the model itself raises, and how
                pass
            self._reset()
        self._attempt(model, args, kwargs, include, exclude, lazy=False)

    def _reset(self) -> None:
        """Drop a lazily widened attempt: its outputs, copy and notes."""
        self.close()
        self.differs.clear()

    def _attempt(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 include: Sequence[str] | None, exclude: Sequence[str] | None, *, lazy: bool) -> None:
        def convert(copied: torch.nn.Module) -> None:
            for m in copied.modules():  # `m.compile()` in place: its compiled call runs the original
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
            if self.device != self.live_device:
                copied.to(self.device)
            copied.double()

        try:
            if lazy:
                shadow, self.lazy = lazy_float64_copy(model, self.device, convert)
            else:
                shadow = _float64_copy(model, self.device)
        except Exception as e:
            if lazy:
                raise
            raise ActivationGuardError(
                f"calibrated tolerances need a float64 copy of the model, but copy.deepcopy({type(model).__name__}) "
                f"failed ({type(e).__name__}: {e}); use tolerance='strict' for this model") from e
        try:
            if not lazy:
                convert(shadow)
            own = _run_dtypes(model, args, kwargs)
            checks = LeafChecks(self.differs)
            checks.install(shadow, own, model, self.lazy)
            a = to_reference(args, self.device)
            kw = to_reference(kwargs, self.device)
            scratch = self.scratch = Scratch(held_budget(self.lazy, self.device))
            # --- gradients: the float64 backward, with the golden's loss, into a temporary golden
            path: str | None = None
            writer: GoldenWriter | None = None
            grads: GradCapture | None = None
            if self.backward is not None:
                self._tmp = tempfile.TemporaryDirectory(prefix="activation_guard-shadow-")
                path = os.path.join(self._tmp.name, "shadow.h5")
                writer = GoldenWriter(path)
                grads = GradCapture(GradRecorder(writer))

            def on_output(frame: Frame, output: Any) -> None:
                for leaf in flatten(output):
                    if (leaf.kind == "tensor" and leaf.tensor is not None
                            and dtype_name(leaf.tensor) in CALIBRATED_DTYPES):
                        scratch.add(frame.name, frame.call, leaf.path, leaf.tensor)
                if grads is not None:
                    grads.on_output(frame, output)

            try:
                with isolated_rng(self.live_device), _no_autocast(), full_fp32_precision(), float32_random():
                    with hooked(shadow, on_output, include, exclude,
                                on_enter=None if grads is None else grads.on_enter) as state:
                        out = run_forward(shadow, a, kw, state, grad=self.grad or grads is not None)
                    if self.lazy is not None:  # replays of the kept copy call its modules again
                        self.lazy.check_lent()
                    if grads is not None and self.backward is not None:
                        grads.backward(shadow, out, self.backward, a, kw)
                checks.recording = False  # replays of the kept copy re-check, but are not this run's calls
                if writer is not None:
                    writer.commit({}, durable=False)
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            finally:
                if grads is not None:
                    grads.close()
            # --- end gradients
        except ActivationGuardError:
            raise
        except Exception as e:
            if lazy:  # the whole copy runs next, and its error (if any) is the one to show
                raise
            if _fails_as_is(model, args, kwargs, self.live_device):  # the model's own error: it keeps its type
                if hasattr(e, "add_note"):
                    e.add_note("activation_guard: raised in the float64 copy of the model that calibrated "
                               "tolerances run first; the model itself raises on these inputs too")
                raise
            hint = ("; explicit casts to float32 (x.float(), x.to(torch.float32), dtype=torch.float32 on float64 "
                    "tensors) run as float64 there, but a tensor created as float32 from no float64 tensor "
                    "(torch.zeros(n, dtype=torch.float32), torch.tensor(v)) or cast to float16/bfloat16 stays so"
                    if "dtype" in str(e) else "")
            raise ActivationGuardError(
                f"the float64 shadow forward for calibrated tolerances failed on {self.device} "
                f"({type(e).__name__}: {e}), while the model runs as it is{hint}; record with calibrate=False "
                f"and compare with tolerance='strict' for this model") from e
        if self.keep_model:
            self.model = shadow
        del shadow
        if path is not None:
            self.reader = GoldenReader(path)

    def reference(self, name: str, call: int, path: str, *, shared: bool = False) -> torch.Tensor | None:
        """The float64 output of layer ``name`` call ``call`` at ``path`` (CPU), if recorded.
        ``shared``: in the scratch file's one buffer, overwritten by the next shared read."""
        entry = None if self.scratch is None else self.scratch.get(name, call, path)
        if entry is None:
            return None
        assert self.scratch is not None
        return self.scratch.load(entry, shared=shared)

    def floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None:
        """``value``'s noise floor against the shadow's float64 output at the same place."""
        ref = self.reference(name, call, path, shared=True)  # read, measured and let go here
        if ref is None or tuple(ref.shape) != tuple(value.shape):
            return None
        f = diff_stats(value, ref)
        return f if f.finite else None

    # --- gradients
    def grad_floor(self, name: str, call: int, path: str, value: torch.Tensor) -> NoiseFloor | None:
        """``value``'s noise floor against the float64 gradient at ``path`` (``"<output|input|param>:<leaf>"``)."""
        grad, _, leaf_path = path.partition(":")
        entry = None if self.reader is None else self.reader.by_grad.get((grad, name, call))
        leaf = None if entry is None else next((x for x in entry.leaves if x.path == leaf_path), None)
        if leaf is not None and leaf.kind == "alias" and self.reader is not None:
            leaf = self.reader.resolve(leaf, f"shadow gradient {path!r} of layer {name!r} call {call}")
        if leaf is None or leaf.kind != "tensor" or leaf.dtype not in CALIBRATED_DTYPES or \
                tuple(leaf.shape) != tuple(value.shape):
            return None
        assert self.reader is not None
        f = diff_stats(value, self.reader.load(leaf, f"shadow gradient {path!r} of layer {name!r} call {call}"))
        return f if f.finite else None
    # --- end gradients

    def measure(self, name: str, call: int, leaves: list[Leaf], table: FloorTable) -> None:
        """Record-time: floors of every real floating leaf of one layer call into ``table``."""
        for leaf in leaves:
            if leaf.kind != "tensor" or leaf.tensor is None or leaf.type_name != "Tensor":
                continue
            if dtype_name(leaf.tensor) not in CALIBRATED_DTYPES:
                continue
            table.add(name, call, leaf.path, self.floor(name, call, leaf.path, leaf.tensor))

    def close(self) -> None:
        self.model = None
        if self.lazy is not None:
            self.lazy.close()
            self.lazy = None
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
