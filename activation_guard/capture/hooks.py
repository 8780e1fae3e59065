"""Forward hooks on every module: which modules, which call, and what each returned.

Eager models are captured *streaming*: the consumer (store or comparator) copies or compares a
layer's output inside its forward hook, so a later in-place op (``ReLU(inplace=True)``, ``add_``)
cannot change it and nothing needs cloning. Compiled regions (``torch.compile(model)``,
``module.compile()``) are captured *staged*: their hooks are traced into the compiled graph, so
they only clone outputs and append them to a list (work dynamo can trace); the consumer reads the
list after the forward. Dynamo caches are reset around the capture so the hooks are compiled in,
and a compiled region whose inner hooks still did not fire is an error, never an empty capture.

Model-level conditions that would make call numbers meaningless are refused with the layer and
the fix: two modules under one qualified name, and a module called from several threads.

About 460 lines: eager and compiled capture share the hook pair and the call stack, and the
refusals must see the same module walk; splitting them would pass that state between modules.
How the hooks go into a module's hook dicts (and out of a copy's) is :mod:`.install`.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable

import torch

from .._core.errors import ActivationGuardError, UnsupportedModelError
from .._core.gcpause import frozen_gc
from ..options.selection import Selector, few
from .install import drop, install

ORIG_MOD = "_orig_mod"  # the eager module inside torch.compile's OptimizedModule wrapper


def _is_optimized(m: torch.nn.Module) -> bool:
    return type(m).__name__ == "OptimizedModule" and hasattr(m, ORIG_MOD)


def _is_compiled(m: torch.nn.Module) -> bool:
    """``module.compile()`` (in place), the ``torch.compile`` wrapper, or a compiled bound forward
    (``m.forward = torch.compile(m.forward)``: after a warm-up, dynamo ran it without the hooks
    added later and its inner layers went silently uncaptured)."""
    return (getattr(m, "_compiled_call_impl", None) is not None or _is_optimized(m)
            or getattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable", None) is not None)


@dataclass(frozen=True)
class Target:
    """What is called (``runner``: the user's object, e.g. a compiled wrapper) and whose
    modules are hooked and named (``root``: the eager module tree), with the compiled regions by
    layer name (``""`` is the root), and the root's ``named_modules()`` walked once."""

    runner: torch.nn.Module
    root: torch.nn.Module
    compiled: tuple[str, ...]
    modules: tuple[tuple[str, torch.nn.Module], ...] = ()


def layer_name(name: str) -> str:
    """A module's layer name: torch.compile's ``_orig_mod`` components removed, so a compiled
    model's layers are named (and compared) as in its eager model."""
    if ORIG_MOD not in name:
        return name
    return ".".join(p for p in name.split(".") if p != ORIG_MOD)


def check_model(model: Any) -> Target:
    """Refuse models whose hooks would not fire faithfully; find the compiled regions."""
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"needs a torch.nn.Module, got {type(model).__name__}")
    root = getattr(model, ORIG_MOD) if _is_optimized(model) else model
    if isinstance(root, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            "torch.jit.ScriptModule does not support forward hooks (pytorch#29037); check the "
            "original eager nn.Module instead."
        )
    if isinstance(root, torch.nn.DataParallel):
        raise UnsupportedModelError(
            "torch.nn.DataParallel runs hooks on per-device replicas concurrently; pass "
            "`model.module` instead."
        )
    compiled = [""] if _is_compiled(model) or _is_compiled(root) else []
    modules = tuple(root.named_modules())  # one walk of the tree, reused by the hooks and the meta
    for name, sub in modules:
        if not name:
            continue
        if isinstance(sub, torch.jit.ScriptModule):
            raise UnsupportedModelError(
                f"submodule {name!r} ({type(sub).__name__}) is a TorchScript module (torch.jit.script/trace), "
                f"which cannot take forward hooks; check a copy of the model with the eager nn.Module it was "
                f"made from in its place."
            )
        if isinstance(sub, torch.nn.DataParallel):
            raise UnsupportedModelError(
                f"submodule {name!r} is a torch.nn.DataParallel, which runs hooks on per-device replicas "
                f"concurrently; check a copy of the model with its `.module` in its place."
            )
        if _is_compiled(sub):
            compiled.append(layer_name(name))
    return Target(model, root, tuple(compiled), modules)


class Frame:
    """One module call in progress (and, once it returned, its record): which layer, which call,
    the arguments it was called with, the call it runs inside (``parent``), the sibling that had
    returned inside that parent when it started (``previous``), how many child calls returned
    inside it (``children``; the last one's name in ``last_child``), the RNG state when it started
    (modules in training mode, when replay may re-run them), and ``data`` for the consumer."""

    __slots__ = ("args", "call", "children", "data", "kwargs", "last_child", "module", "name", "parent", "previous",
                 "rng")

    def __init__(self, name: str, module: torch.nn.Module, args: Any, kwargs: Any, parent: Frame | None):
        self.name = name
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.parent = parent
        self.previous = None if parent is None else parent.last_child
        self.call = -1  # numbered when it returns (calls count completions, children first)
        self.children = 0
        self.last_child: str | None = None
        self.rng: tuple[torch.Tensor, Any] | None = None
        self.data: Any = None


LayerCallback = Callable[[Frame, Any], None]
EnterCallback = Callable[[Frame], None]


@dataclass
class HookState:
    """Per-forward bookkeeping: call counts per layer, the calls in progress (``stack``), the
    hooked modules by ``id`` (to name the layer an exception came from), layers called from another
    thread, and (compiled regions) calls staged for the consumer. While ``replaying`` (a module
    re-run on golden inputs) the hooks stand aside."""

    calls: dict[str, int] = field(default_factory=dict)
    modules: dict[int, str] = field(default_factory=dict)
    foreign_threads: dict[str, int] = field(default_factory=dict)
    stack: list[Frame] = field(default_factory=list)
    staged: list[tuple[Frame, Any]] = field(default_factory=list)
    replaying: bool = False
    want_rng: bool = False


def _layers(modules: Sequence[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """Each module once, under its first name, compile wrappers skipped (their eager module is
    hooked instead); two different modules under one name are refused."""
    by_name: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    out = []
    for raw, mod in modules:
        if id(mod) in seen or _is_optimized(mod):
            continue
        seen.add(id(mod))
        name = layer_name(raw)
        other = by_name.get(name)
        if other is not None:
            raise UnsupportedModelError(
                f"two different modules are registered under the name {name or '<root>'!r}: "
                f"{type(other).__name__} and {type(mod).__name__} (a name with '.' put into `_modules` "
                f"collides with a nested module's name); their calls would be merged into one layer. "
                f"Register one of them under another name.")
        by_name[name] = mod
        out.append((name, mod))
    return out


def _snapshot(output: Any) -> Any:
    """A copy of an output whose tensors are cloned: what a traced hook can do safely."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), output)


RngState = tuple[torch.Tensor, Any]  # the CPU generator's state, and every CUDA device's (a list, or None)


def rng_state() -> RngState:
    """The generators a module may draw from: the CPU's, and once CUDA is initialized every CUDA
    device's (a model on ``cuda:1`` draws from that device's generator whatever the current device
    is; each state is a few bytes read on the host)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def rng_moved(state: RngState) -> bool:
    """Whether any generator moved since ``state`` was taken (the call drew random numbers)."""
    now = rng_state()
    if not torch.equal(now[0], state[0]):
        return True
    if now[1] is None or state[1] is None:
        return False
    return len(now[1]) != len(state[1]) or any(not torch.equal(a, b) for a, b in zip(now[1], state[1]))


def _rng_state(module: torch.nn.Module) -> RngState | None:
    """The generators a training-mode module may draw from, as they are when it starts."""
    return rng_state() if module.training else None


@contextmanager
def hooked(
    target: Target | torch.nn.Module,
    on_output: LayerCallback,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    *,
    on_enter: EnterCallback | None = None,
    want_rng: bool = False,
    on_abandon: EnterCallback | None = None,
) -> Iterator[HookState]:
    """Install hooks on every (selected) module; always remove them.

    ``on_enter(frame)`` runs when a selected module is called, before its forward (its arguments
    as passed); ``on_output(frame, output)`` when it returns (eager), or for each staged call after
    :func:`run_forward` (compiled regions, whose arguments and outputs are cloned snapshots).
    Modules return post-order, so children complete (and are reported) before their parents.
    ``on_abandon(frame)``: a call that raised, caught by a caller, is dropped when its caller returns.
    """
    if not isinstance(target, Target):
        target = check_model(target)
    state = HookState(want_rng=want_rng)
    handles: list[Callable[[], None]] = []
    layers = _layers(target.modules)
    for name, mod in layers:
        state.modules[id(mod)] = name
    owner = threading.get_ident()
    staged = bool(target.compiled)
    wanted_by = Selector(include, exclude, [n for n, _ in layers])
    stack = state.stack

    # one pre and one post function for every module (the layer found by the module's id): a
    # closure pair per module cost ~1 us per module and check to build, on models of many layers
    info: dict[int, tuple[str, bool]] = {id(mod): (name, wanted_by(name)) for name, mod in layers}
    installed: dict[int, torch.nn.Module] = {}  # the id of each pre-hook of ours -> the module it is on

    # marks our two hooks, so that the functions never name each other: a reference cycle among
    # them would keep the whole comparator or recorder alive after the capture until a full
    # collection (the float64 shadow model of a calibrated compare included)
    token = object()

    def copied(mod: torch.nn.Module, hooks: Mapping[int, Any], offset: int) -> tuple[str, bool] | None:
        """The layer of a module called with our hooks that we did not put them on: a copy of a
        hooked module. A shallow copy (``copy.copy``, a data-parallel replica) shares the hook
        dicts of the module it was copied from and runs under its name. A deep copy (a lazily
        made EMA teacher) got copies of the dicts, ours with them: it is not a module of the
        model, and whether it carries our hooks depends on when it was made, so it drops them
        here and is not a layer."""
        for k, v in list(hooks.items()):
            if getattr(v, "_ag_token", None) is token:
                orig = installed.get(k - offset)
                if orig is not None and hooks is (orig._forward_pre_hooks if offset == 0 else orig._forward_hooks):
                    return info[id(orig)]
                drop(mod, token)
                return None
        return None

    def pre(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if state.replaying:
            return
        known = info.get(id(mod)) or copied(mod, mod._forward_pre_hooks, 0)
        if known is None:
            return
        name, wanted = known
        if not staged and threading.get_ident() != owner:  # numbered by thread timing: refused
            if wanted:
                state.foreign_threads[name] = state.foreign_threads.get(name, 0) + 1
            return
        if staged and wanted and on_enter is not None:
            args, kwargs = _snapshot((args, kwargs))
        frame = Frame(name, mod, args, kwargs, stack[-1] if stack else None)
        if state.want_rng and wanted and not staged:
            # never inside a compiled region: dynamo cannot trace get_rng_state, and a graph
            # break at every module would compare another graph than the one that runs
            frame.rng = _rng_state(mod)
        stack.append(frame)
        if wanted and on_enter is not None and not staged:
            on_enter(frame)

    def post(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if state.replaying or (not staged and threading.get_ident() != owner):
            return
        known = info.get(id(mod)) or copied(mod, mod._forward_hooks, 1)
        if known is None:
            return
        frame = stack.pop()
        while frame.module is not mod and stack:
            # a call that raised, its exception caught by a caller (try a fast path, fall back):
            # it never returns, so its frame is dropped here, not filed under this call's name
            if on_abandon is not None:
                on_abandon(frame)
            frame = stack.pop()
        name, wanted = known
        k = state.calls.get(name, 0)
        state.calls[name] = k + 1
        frame.call = k
        if frame.parent is not None:
            frame.parent.last_child = name
            frame.parent.children += 1
        if not wanted:
            return
        if staged:
            state.staged.append((frame, _snapshot(output)))
        else:
            on_output(frame, output)

    pre._ag_capture = True  # type: ignore[attr-defined]  # not a user's pre-hook (replay.call_as_captured)
    pre._ag_token = post._ag_token = token  # type: ignore[attr-defined]

    # objects alive now (the model, torch, a golden's parsed index) are not this forward's garbage
    with frozen_gc():
        try:
            # post: prepend=True (distributed), eager and staged alike: the output as the
            # module returned it, before other forward hooks rewrite it (tensor parallelism's own
            # hook turns a DTensor into a local shard; docs/distributed.md)
            handles.append(install([mod for _, mod in layers], pre, post, installed))
            if staged:
                _reset_dynamo()  # compile the hooks in (hooks added later are not guarded on)
                announce_compile(target)
            yield state
            _check_root_ran(target, layers, state)
            if staged:
                _check_compiled_capture(target, layers, state)
                for frame, out in state.staged:
                    if on_enter is not None:
                        on_enter(frame)
                    on_output(frame, out)
                state.staged.clear()
            if state.foreign_threads:
                raise _thread_error(state.foreign_threads)
        finally:
            for h in handles:
                h()
            installed.clear()  # deep copies that kept our hooks drop them when next called (``copied``)
            if staged:
                _reset_dynamo()  # graphs compiled with our hooks must not outlive them


def hook_notes(target: Target) -> list[str]:
    """Report notes for forward hooks the model carries itself. Ours run first (the output as the
    module returned it: tensor parallelism's own hook turns it into a shard), so what a user's hook
    changes is seen by the layers that receive it, and, on the model itself, by no one."""
    hooked_names = [layer_name(n) for n, m in target.modules
                    if any(not _torch_owned(h) for h in (getattr(m, "_forward_hooks", None) or {}).values())]
    if not hooked_names:
        return []
    out = []
    if "" in hooked_names:
        out.append("the model itself has forward hooks of its own, which run after its output is read: what they "
                   "change in the output the caller receives is not compared")
    inner = [n for n in hooked_names if n]
    if inner:
        shown = few(inner)
        out.append(f"{len(inner)} layer(s) have forward hooks of their own ({shown}), which run after their outputs "
                   f"are read: what those hooks change is judged in the layers that receive it")
    return out


def _torch_owned(hook: Any) -> bool:
    """A hook torch installed itself (tensor parallelism's input/output conversions): not a user's."""
    fn = getattr(hook, "func", hook)  # functools.partial
    return str(getattr(fn, "__module__", "") or "").startswith("torch.")


# where the one line saying that a compiled model is being compiled goes: stderr, unless a caller
# (the pytest plugin: a live line in the terminal, past output capture) says otherwise
COMPILE_NOTICE: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "activation_guard_compile_notice", default=None)


def announce_compile(target: Target) -> None:
    """Compiling with the hooks in takes seconds to minutes, and nothing else is said meanwhile:
    one line saying what is happening."""
    regions = ", ".join(repr(r or "<root>") for r in target.compiled[:3]) + (
        ", ..." if len(target.compiled) > 3 else "")
    line = (f"activation_guard: torch.compile is compiling {type(target.root).__name__} with activation_guard's "
            f"hooks (compiled: {regions}); this can take a while")
    sink = COMPILE_NOTICE.get()
    if sink is None:
        print(line, file=sys.stderr, flush=True)
    else:
        sink(line)


def _reset_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def _check_root_ran(target: Target, layers: list[tuple[str, torch.nn.Module]], state: HookState) -> None:
    """The forward returned, but the model's own hooks never fired: its ``__call__`` does not go
    through ``nn.Module.__call__``. Its output, and its own code after its last child, would go
    uncompared while every layer inside matched: an error, never a pass."""
    root = next((m for n, m in layers if n == ""), None)
    if root is None or state.calls.get(""):
        return
    cls = type(root)
    overridden = cls.__call__ is not torch.nn.Module.__call__
    why = f"{cls.__name__} overrides __call__" if overridden else "it was not called through torch.nn.Module.__call__"
    raise UnsupportedModelError(
        f"the model's own forward hooks never ran ({why}), so its output, and the code of its forward after its "
        f"last layer, would not be compared. Give it the standard __call__, or check a wrapper module whose "
        f"forward calls model.forward(...).")


def _check_compiled_capture(target: Target, layers: list[tuple[str, torch.nn.Module]], state: HookState) -> None:
    """A compiled region that ran while none of its inner modules' hooks fired was captured
    empty (dynamo skipped hooks it had not guarded on): an error, never a pass."""
    names = [n for n, _ in layers]
    for region in target.compiled:
        if not state.calls.get(region):
            continue
        inner = [n for n in names if n != region and (region == "" or n.startswith(region + "."))]
        if inner and not any(state.calls.get(n) for n in inner):
            raise UnsupportedModelError(
                f"compiled module {region or '<root>'!r} ran, but the hooks of the {len(inner)} modules inside it "
                f"did not fire, so their outputs were not captured; torch.compile skipped them. Check the eager "
                f"module instead (for `torch.compile(m)` pass `m`; for `m.compile()` use a copy without it).")


def _thread_error(foreign: Mapping[str, int]) -> ActivationGuardError:
    shown = ", ".join(f"{n or '<root>'!r} ({c} call(s))" for n, c in list(foreign.items())[:5])
    return ActivationGuardError(
        f"layers were called from another thread than the forward's: {shown}. Their call numbers would "
        f"depend on thread timing, so they cannot be matched with a golden; run those modules on the "
        f"calling thread (or exclude them with exclude=[...]).")


GRAD_HINT = ("this forward needs autograd (torch.autograd.grad or .backward() inside forward), but "
             "activation_guard runs forwards under torch.no_grad() by default; pass the option grad=True")


def run_forward(
    target: Target | torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], state: HookState,
    *, grad: bool = False,
) -> Any:
    """Run the forward (under no_grad unless ``grad``); name the innermost running layer if it
    raises, and say which option fixes a forward that needed autograd."""
    runner = target.runner if isinstance(target, Target) else target
    try:
        with torch.set_grad_enabled(grad):
            return runner(*args, **kwargs)
    except Exception as exc:
        if getattr(exc, "_ag_noted", False):
            raise
        where = innermost_layer(exc.__traceback__, state.modules)
        notes = []
        if where is not None:
            notes.append(f"activation_guard: raised inside layer {where or '<root>'!r}")
        if not grad and isinstance(exc, RuntimeError) and "does not require grad" in str(exc):
            notes.append(f"activation_guard: {GRAD_HINT}")
        hint = dict_args_hint(target.root if isinstance(target, Target) else target, args)
        if hint is not None:
            notes.append(f"activation_guard: {hint}")
        for note in notes:
            if hasattr(exc, "add_note"):
                exc.add_note(note)
        with contextlib.suppress(Exception):
            exc._ag_noted = True  # type: ignore[attr-defined]
        raise


_MAPPING_WORDS = ("dict", "Dict", "Mapping", "BatchEncoding", "TypedDict")


def dict_args_hint(model: Any, args: tuple[Any, ...]) -> str | None:
    """When the one positional argument is a dict and the model's forward has no single
    positional parameter meant to take one: the forward that raised most likely wanted the
    dict's entries as keyword arguments, which is what ``kwargs=`` passes. None otherwise."""
    if len(args) != 1 or not isinstance(args[0], Mapping):
        return None
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError, AttributeError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 1:
        ann = positional[0].annotation
        text = ann if isinstance(ann, str) else getattr(ann, "__name__", None) or repr(ann)
        if ann is not inspect.Parameter.empty and any(w in str(text) for w in _MAPPING_WORDS):
            return None  # forward(self, batch: dict): the dict is meant as its one argument
    keys = ", ".join(f"{k!r}: ..." for k in list(args[0])[:3]) + (", ..." if len(args[0]) > 3 else "")
    return (f"args is a {type(args[0]).__name__}, so the model was called with it as its one positional "
            f"argument, model({{{keys}}}); to pass its entries as keyword arguments, model(**d), give it as "
            f"kwargs=: check(model, kwargs=d) or compare(model, kwargs=d, ...)")


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
    """``args`` as ``torch.export`` reads it: a tuple is the positional arguments; anything else
    (a tensor, a list, a dict) is the one positional argument."""
    a = args if isinstance(args, tuple) else (args,)
    if kwargs is None:
        kw: dict[str, Any] = {}
    elif isinstance(kwargs, Mapping):
        kw = dict(kwargs)
    else:
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    return a, kw

