"""What an origin says when the replay's own assumption does not hold.

A replay attributes a difference by re-running calls on the golden's inputs, their children
returning the golden's outputs. That assumes each child that passed returned the golden's values
and that the call got the recorded arguments. Two cases break it without anything failing:
a child that passed a difference on (a looser ``tolerances`` entry, or a child the golden does not
have), and a plain string argument that changed (replays pass strings as given). Unrecognized, the
report would blame a parent's code, "randomness", or the wrong layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..capture.hooks import Frame
from ..options.selection import display_name
from ..results import LayerResult, Origin
from ..store import CallEntry
from .args import string_changes


def unjudged_source(frame: Frame, found: Origin, earlier: Sequence[LayerResult]) -> Origin | None:
    """A call inside ``frame`` (or, for parent code between two children, the child that returned
    just before) whose output reached the diverging call without being held to the tolerance it
    failed: a layer not in the golden (renamed or new: it ran live in the replay too), or one that
    passed under a looser ``tolerances`` entry with values that differ. The difference may come
    from there, not from parent code or randomness (a changed layer under a
    loosened tolerance was reported as its parent's code)."""
    if found.kind == "parent-code" and found.child is not None:  # between two children: the one before
        names = {found.previous} if found.previous is not None else set()
    else:  # the call's own children (its replay ran them, or returned their golden outputs)
        prefix = "" if frame.name == "" else frame.name + "."
        names = {r.name for r in earlier if r.name != frame.name and r.name.startswith(prefix)}
    for r in reversed(earlier):
        if r.name not in names or r.phase != "forward":
            continue
        tname = r.type_name or "?"
        if r.status == "unexpected":
            return Origin(r.name, r.call, "unknown", type_name=tname, detail=(
                f"not in the golden (renamed or new: see rename=), so nothing judged its output, which "
                f"{display_name(frame.name)!r} goes on to use; the difference may come from there"))
        if (r.status == "match" and r.max_abs_diff is not None and r.max_abs_diff > 0
                and "tolerances[" in (r.tolerance_source or "")
                # a parent whose own replay (its children returning the golden's values) differs
                # by far more than the child passed on changed its own code
                and not (found.own_error is not None and found.own_error > 10 * r.max_abs_diff)):
            rule = (f"rtol={r.rtol:g}, atol={r.atol:g}" if r.rtol is not None and r.atol is not None
                    else f"SQNR {r.energy.sqnr_db():.1f} dB" if r.energy is not None else "no element tolerance")
            return Origin(r.name, r.call, "unknown", r.max_abs_diff, type_name=tname, detail=(
                f"its output differs from the golden's (max abs diff {r.max_abs_diff:.3g}) but passed under "
                f"{r.tolerance_source} ({rule}); {display_name(frame.name)!r} goes on to use "
                f"it and fails its own tolerance: the difference may come from here"))
    return None


def inexact_before(frame: Frame, found: Origin, earlier: Sequence[LayerResult]) -> Origin | None:
    """An origin in a parent's code that no replay of that code showed (the first diverging call,
    re-run on the golden's inputs, gave the golden's output, and its live inputs differ) holds only
    if every call before it returned the golden's values. One that matched *within tolerance* but
    not exactly may have passed on a difference that grew to this one (an RMSNorm epsilon moving
    its output by 8e-6, under strict's 1e-5, found out of tolerance two layers later): then the
    origin is ``unknown``, and says which call and what tells the two apart."""
    if found.kind != "parent-code" or found.name == frame.name:
        return None
    inexact = [r for r in earlier if r.phase == "forward" and r.status == "match" and r.max_abs_diff is not None
               and r.max_abs_diff > 0 and r.name != frame.name]
    if not inexact:
        return None
    first = inexact[0]
    detail = (f"re-run on the golden's inputs it gives the golden's output, and its inputs differ; "
              f"{len(inexact)} call(s) before it matched within tolerance but not exactly (the first: "
              f"{display_name(first.name)!r} call {first.call}, max abs diff {first.max_abs_diff:.3g}), so a "
              f"difference under tolerance may have grown into this one, or {display_name(found.name)!r}'s own code "
              f"{_where(found)} changed; replay='all' replays each call and tells them apart")
    return Origin(frame.name, frame.call, "unknown", found.own_error, type_name=found.type_name, maybe_code=True,
                  detail=detail)


def _where(found: Origin) -> str:
    child = display_name(found.child) if found.child is not None else None
    if found.previous is not None and child is not None:
        return f"between {display_name(found.previous)!r} and {child!r}"
    return f"before {child!r}" if child is not None else ""


def string_hint(entry: CallEntry, frame: Frame) -> str:
    """What to add to an origin that blames a call's own code when a plain string it was given
    differs from the recording (:func:`.args.string_changes`), or ""."""
    strings = string_changes(entry, frame)
    if not strings:
        return ""
    return (f"; but its string argument(s) differ from the recording ({', '.join(strings)}), which a replay passes "
            f"as given: if one selects what it computes, its caller's code changed it")
