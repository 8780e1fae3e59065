"""Putting the capture's hooks into modules' hook dicts, and taking them out again.

What ``register_forward_pre_hook``/``register_forward_hook`` do, for thousands of modules per
record or compare, without their ``RemovableHandle`` objects; and removing the hooks a copy of a
hooked module carried away with it (``copy.deepcopy`` copies the hook dicts, ours included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch


def install(mods: Sequence[torch.nn.Module], pre: Callable[..., None], post: Callable[..., None],
            installed: dict[int, torch.nn.Module]) -> Callable[[], None]:
    """Add a with-kwargs forward pre-hook and a prepended with-kwargs forward hook to each of
    ``mods``; return what removes them all (also run here if installing fails half-way).
    ``installed`` gets the id of each pre-hook -> its module (the post-hook's id is one more).

    What ``register_forward_pre_hook``/``register_forward_hook`` do, without their two
    ``RemovableHandle`` objects (weak references to four dicts each): those cost ~5 us per module
    and check, a sixth of the whole per-layer budget on models of many small layers. Hook ids come
    from the same counter, so they never collide with a user's hooks; if a torch version lacks
    these dicts, the public API is used.
    """
    done: list[tuple[Any, Any, Any, Any, int]] = []
    handles: list[Any] = []
    counter = torch.utils.hooks.RemovableHandle

    def remove() -> None:
        for pre_hooks, pre_kw, hooks, hooks_kw, i in done:
            pre_hooks.pop(i, None)
            pre_kw.pop(i, None)
            hooks.pop(i + 1, None)
            hooks_kw.pop(i + 1, None)
        done.clear()
        for h in handles:
            h.remove()
        handles.clear()

    try:
        for mod in mods:
            try:
                pre_hooks, pre_kw = mod._forward_pre_hooks, mod._forward_pre_hooks_with_kwargs
                hooks, hooks_kw = mod._forward_hooks, mod._forward_hooks_with_kwargs
            except AttributeError:
                handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(mod.register_forward_hook(post, with_kwargs=True, prepend=True))
                continue
            i = counter.next_id
            counter.next_id = i + 2
            done.append((pre_hooks, pre_kw, hooks, hooks_kw, i))
            installed[i] = mod
            pre_hooks[i] = pre
            pre_kw[i] = True
            hooks[i + 1] = post
            hooks_kw[i + 1] = True
            if len(hooks) > 1:  # the module has forward hooks of its own: ours goes first
                hooks.move_to_end(i + 1, last=False)  # type: ignore[attr-defined]
    except BaseException:
        remove()
        raise
    return remove


def drop(mod: torch.nn.Module, token: object) -> None:
    """Remove the hooks marked with ``token`` from a module that got them by being copied from a
    hooked one. (torch iterates over a snapshot of the hook dicts, so this is safe inside a hook.)"""
    for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
        for k in [k for k, v in hooks.items() if getattr(v, "_ag_token", None) is token]:
            hooks.pop(k, None)
            mod._forward_pre_hooks_with_kwargs.pop(k, None)
            mod._forward_hooks_with_kwargs.pop(k, None)
