"""Forward hooks on every module, and flattening of arbitrary outputs into addressed leaves.

Capture never keeps references to live tensors beyond the hook call: the consumer (store or
comparator) either copies the bytes or compares them *inside* the hook, which is what makes a
later in-place op (``ReLU(inplace=True)``, ``add_``) harmless without cloning every output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable

import torch

from .errors import UnsupportedModelError
from .selection import selected

MAX_DEPTH = 32


@dataclass
class Leaf:
    """One addressed value inside a layer's output.

    ``kind`` is ``tensor`` (also used for Python numbers, stored as 0-d tensors), ``none``,
    ``str`` or ``object`` (anything else: recorded by type name only, never iterated, so a
    generator or a KV-cache object is neither consumed nor crashes the capture).
    """

    path: str
    kind: str
    tensor: torch.Tensor | None = None
    type_name: str = ""
    value: str | None = None


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def flatten(obj: Any, prefix: str = "", depth: int = 0) -> list[Leaf]:
    """Flatten an output into leaves with stable slash-separated paths.

    Tuples/lists are addressed by index, mappings (including Hugging Face ``ModelOutput``) and
    dataclasses by key/field name. A bare tensor output has the empty path.
    """
    out: list[Leaf] = []
    _flatten_into(obj, prefix, depth, out)
    return out


def _flatten_into(obj: Any, prefix: str, depth: int, out: list[Leaf]) -> None:
    if isinstance(obj, torch.Tensor):
        _tensor_leaf(obj, prefix, depth, out)
        return
    if obj is None:
        out.append(Leaf(prefix, "none", type_name="None"))
        return
    if isinstance(obj, bool):
        out.append(Leaf(prefix, "tensor", tensor=torch.tensor(obj), type_name="bool"))
        return
    if isinstance(obj, int):
        if -(2**63) <= obj < 2**63:
            out.append(Leaf(prefix, "tensor", tensor=torch.tensor(obj, dtype=torch.int64), type_name="int"))
        else:
            out.append(Leaf(prefix, "str", type_name="int", value=str(obj)))
        return
    if isinstance(obj, float):
        out.append(Leaf(prefix, "tensor", tensor=torch.tensor(obj, dtype=torch.float64), type_name="float"))
        return
    if isinstance(obj, complex):
        out.append(Leaf(prefix, "tensor", tensor=torch.tensor(obj, dtype=torch.complex128), type_name="complex"))
        return
    if isinstance(obj, str):
        out.append(Leaf(prefix, "str", type_name="str", value=obj))
        return
    if depth >= MAX_DEPTH:
        out.append(Leaf(prefix, "object", type_name=type(obj).__name__))
        return
    if isinstance(obj, Mapping):
        if not obj and prefix:
            out.append(Leaf(prefix, "object", type_name=f"empty {type(obj).__name__}"))
        for k, v in obj.items():
            _flatten_into(v, _join(prefix, _escape(str(k))), depth + 1, out)
        return
    if isinstance(obj, (tuple, list)):
        if not obj:
            out.append(Leaf(prefix, "object", type_name=f"empty {type(obj).__name__}"))
        for i, v in enumerate(obj):
            _flatten_into(v, _join(prefix, str(i)), depth + 1, out)
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _flatten_into(getattr(obj, f.name, None), _join(prefix, _escape(f.name)), depth + 1, out)
        return
    out.append(Leaf(prefix, "object", type_name=type(obj).__name__))


def _tensor_leaf(t: torch.Tensor, prefix: str, depth: int, out: list[Leaf]) -> None:
    """Plain strided tensors are leaves; other tensor kinds are reduced to what they hold."""
    if getattr(t, "is_nested", False):
        _flatten_into(list(t.unbind()), prefix, depth + 1, out)
        return
    if t.device.type == "meta":
        out.append(Leaf(prefix, "object", type_name=f"meta Tensor{list(t.shape)}"))
        return
    if t.is_quantized:
        t = t.dequantize()
    elif t.layout != torch.strided:
        t = t.to_dense()
    out.append(Leaf(prefix, "tensor", tensor=t, type_name="Tensor"))


def check_model(model: Any) -> torch.nn.Module:
    """Refuse models whose submodule hooks would silently not fire."""
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"activation_guard needs a torch.nn.Module, got {type(model).__name__}"
        )
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise UnsupportedModelError(
            "this model was wrapped by torch.compile; compiled graphs bypass per-module hooks, so "
            "layer outputs cannot be captured. Check the eager module instead: pass "
            "`model._orig_mod` (and compare the compiled model's final output separately)."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            "torch.jit.ScriptModule does not support forward hooks (pytorch#29037); check the "
            "original eager nn.Module instead."
        )
    if isinstance(model, (torch.nn.DataParallel,)):
        raise UnsupportedModelError(
            "torch.nn.DataParallel runs hooks on per-device replicas concurrently; pass "
            "`model.module` instead."
        )
    # The same wrappers nested inside an eager model: installing hooks on a ScriptModule raises a
    # bare RuntimeError, and layers inside a compiled submodule would silently not be captured.
    for name, sub in model.named_modules():
        if not name:
            continue
        if isinstance(sub, torch.jit.ScriptModule):
            why = "a TorchScript module (torch.jit.script/trace), which cannot take forward hooks"
            fix = "the eager nn.Module it was made from"
        elif type(sub).__name__ == "OptimizedModule" and hasattr(sub, "_orig_mod"):
            why = "wrapped by torch.compile, whose graph bypasses the hooks of the layers inside"
            fix = f"its eager module (`{name}._orig_mod`)"
        elif isinstance(sub, torch.nn.DataParallel):
            why = "a torch.nn.DataParallel, which runs hooks on per-device replicas concurrently"
            fix = "its `.module`"
        else:
            continue
        raise UnsupportedModelError(
            f"submodule {name!r} ({type(sub).__name__}) is {why}; check a copy of the model "
            f"with {fix} in its place."
        )
    return model


LayerCallback = Callable[[str, int, torch.nn.Module, Any], None]


@dataclass
class HookState:
    """Per-forward bookkeeping: call counts per module, and the hooked modules by ``id`` (to
    name the layer an exception came from)."""

    calls: dict[str, int] = field(default_factory=dict)
    modules: dict[int, str] = field(default_factory=dict)


@contextmanager
def hooked(
    model: torch.nn.Module,
    on_output: LayerCallback,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> Iterator[HookState]:
    """Install forward hooks on every (selected) module of ``model``; always remove them.

    ``on_output(name, call, module, output)`` runs when a module's forward returns. Modules run
    post-order, so children complete (and are reported) before their parents.
    """
    state = HookState()
    handles: list[Any] = []
    names = state.modules
    for name, mod in model.named_modules():
        names.setdefault(id(mod), name)

    def make_hook(name: str, wanted: bool) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            k = state.calls.get(name, 0)
            state.calls[name] = k + 1
            if wanted:
                on_output(name, k, mod, output)

        return hook

    # Objects alive now (the model, torch, a golden's parsed index) are not this forward's
    # garbage, yet the cyclic collector would rescan them every few hundred allocations of the
    # per-layer work: ~30% of compare's time on a 1,500-layer model. Freeze them meanwhile (new
    # objects are still collected); leave a caller's own freeze alone.
    frozen = gc.isenabled() and not gc.get_freeze_count()
    if frozen:
        gc.freeze()
    try:
        for name, mod in model.named_modules():
            if id(mod) in names and names[id(mod)] != name:
                continue
            wanted = selected(name, include, exclude)
            # no forward pre-hook: it would cost ~3 us per layer call only to name the layer
            # of an exception, which run_forward reads from the traceback instead
            handles.append(mod.register_forward_hook(make_hook(name, wanted)))
        yield state
    finally:
        for h in handles:
            h.remove()
        if frozen:
            gc.unfreeze()


def run_forward(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], state: HookState
) -> Any:
    """Run the forward under no_grad; name the innermost running layer if it raises."""
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    except Exception as exc:
        where = None if getattr(exc, "_ag_noted", False) else innermost_layer(exc.__traceback__, state.modules)
        if where is not None:
            note = f"activation_guard: raised inside layer {where or '<root>'!r}"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            with contextlib.suppress(Exception):
                exc._ag_noted = True  # type: ignore[attr-defined]
        raise


def innermost_layer(tb: TracebackType | None, modules: Mapping[int, str]) -> str | None:
    """Name of the innermost hooked module with a frame on traceback ``tb`` (a method running
    with ``self`` bound to it, ``Module._call_impl`` included): the layer that was running when
    the exception was raised. Free until an error happens; also right after a layer raised and
    its parent caught that and raised something else later."""
    where = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in modules and isinstance(obj, torch.nn.Module):
            where = modules[id(obj)]
        tb = tb.tb_next
    return where


def normalize_inputs(args: Any, kwargs: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(args, tuple):
        a = args
    elif isinstance(args, list):
        a = tuple(args)
    else:
        a = (args,)
    if kwargs is None:
        kw: dict[str, Any] = {}
    elif isinstance(kwargs, Mapping):
        kw = dict(kwargs)
    else:
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    return a, kw

