"""How report values read: number formats, why a status fails, how layers and gradients are named,
and a fingerprinted output's evidence lines. Shared by the text report, the HTML page and the
Markdown summary, so a number reads the same everywhere.
"""

from __future__ import annotations

import math
from typing import Any

from ..options.selection import display_name
from ..results import LayerResult, LeafResult

WHY = {
    "diverged": "values outside tolerance",
    "nonfinite": "new NaN/Inf values",
    "shape": "output shape changed",
    "local_shard": "a rank's local shard, not the full tensor",  # distributed
    "dtype": "output dtype changed",
    "structure": "output structure changed",
    "missing": "layer call did not run",
    "unexpected": "layer call not in the golden",
}
# --- gradients
GRAD_WHY = {
    "shape": "gradient shape changed",
    "dtype": "gradient dtype changed",
    "structure": "gradient structure changed",
    "missing": "gradient not computed in the live run",
    "unexpected": "gradient not in the golden",
}


# C0 and C1 control characters (ESC starts terminal sequences; CR and LF forge report lines), and
# the bidirectional-text controls that make a terminal or a diff viewer show text out of order
_UNSAFE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_UNSAFE.update({c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def safe_line(text: str) -> str:
    """One line of terminal text with every control character written as an escape.

    Layer names, output keys, class names and a golden's meta come from the model or from the file,
    and reach terminals, CI logs and ``git diff`` (textconv): an ESC there can clear the screen or
    hide lines, a newline forge a report line, U+202E reverse what is shown. Applied to each line
    a text output is built of, so no field can break out of its line."""
    return text.translate(_UNSAFE) if not text.isprintable() else text


def why(layer: LayerResult) -> str:
    """The short reason a row failed, worded for outputs or for gradients."""
    if layer.phase != "forward" and layer.status in GRAD_WHY:
        return GRAD_WHY[layer.status]
    return WHY.get(layer.status, layer.status)


def gradient_text(layer: LayerResult, path: str | None = None) -> str:
    """'gradient w.r.t. its input args/0', 'gradient w.r.t. its output', "gradient of parameter 'weight'"."""
    p = layer.path if path is None else path
    if layer.phase == "param-grad":
        return f"gradient of parameter {p!r}" if p else "parameter gradients"
    return f"gradient w.r.t. its {layer.wrt or '?'}" + (f" {p}" if p else "")


def row_name(layer: LayerResult) -> str:
    """A layer's name in the context table, marked when the row is a gradient."""
    n = display_name(layer.name)
    if layer.phase == "param-grad":
        return f"{n} (param grads)"
    if layer.phase == "backward":
        return f"{n} (grad {'out' if layer.wrt == 'output' else 'in'})"
    return n
# --- end gradients


def fmt(x: Any, digits: int = 7) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, complex):
        return f"{x.real:.{digits}g}{x.imag:+.{digits}g}j"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        if x == 0:
            return "0"
        return f"{x:.{digits}g}" if 1e-3 <= abs(x) < 1e6 else f"{x:.{digits - 4}e}"
    return str(x)


def fmt_pair(a: Any, b: Any) -> tuple[str, str]:
    """Two values with enough digits to tell them apart (7 significant, more when needed)."""
    for digits in (7, 10, 13, 17):
        fa, fb = fmt(a, digits), fmt(b, digits)
        if fa != fb:
            break
    return fa, fb


def abs_diff(a: Any, b: Any) -> float | None:
    """|b - a| of two reported element values (NaN involved: inf, as the comparison counts it)."""
    if not all(isinstance(v, (int, float, complex)) for v in (a, b)):
        return None
    d = float(abs(b - a))
    return math.inf if math.isnan(d) else d


def fmt_diff(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


def estimate_ratio(layer: LayerResult) -> float | None:
    """The largest estimated ||diff||_2 / threshold over a layer's fingerprinted outputs (the sketch
    check fails above 1)."""
    ratios = [leaf.estimated_l2 / leaf.l2_threshold for leaf in layer.leaves
              if leaf.estimate and leaf.estimated_l2 is not None and leaf.l2_threshold]
    return max(ratios) if ratios else None


def leaf_ratio(leaf: LeafResult) -> float | None:
    """A fingerprinted output's estimated ||diff||_2 over the sketch's threshold (fails above 1)."""
    if not leaf.estimate or leaf.estimated_l2 is None or not leaf.l2_threshold:
        return None
    return leaf.estimated_l2 / leaf.l2_threshold


def estimated_l2(layer: LayerResult) -> float | None:
    """The largest estimated ||diff||_2 over a layer's fingerprinted outputs."""
    ests = [leaf.estimated_l2 for leaf in layer.leaves if leaf.estimate and leaf.estimated_l2 is not None]
    return max(ests) if ests else None


def sketch_blind(layer: LayerResult) -> str | None:
    """When a fingerprinted output failed on its exact checks (sampled elements, max, min, sum)
    while its sketch stayed under its limit, the sentence that says so: the difference is one a
    sketch does not see, so layers after it whose fingerprints "match" are no evidence that they
    are unchanged. None otherwise."""
    for leaf in layer.leaves:
        ratio = leaf_ratio(leaf)
        if leaf.status == "match" or ratio is None or ratio > 1 or leaf.fingerprint_check in (None, "sketch",
                                                                                              "nonfinite"):
            continue
        if leaf.fingerprint_check == "sample":
            seen = f"only {leaf.mismatched} of {leaf.sampled} sampled elements saw this difference"
        else:
            seen = f"only the {leaf.fingerprint_check}imum saw this difference" if leaf.fingerprint_check in (
                "max", "min") else f"only the {leaf.fingerprint_check} saw this difference"
        return (f"{seen}; the sketch stayed under its limit (est/limit {ratio:.2g}), so later layers whose "
                f"fingerprints \"match\" are not evidence that they are unchanged (a difference this small or "
                f"sparse is below what a sketch sees; record those layers in full to compare them)")
    return None


def estimate_lines(leaf: LeafResult) -> list[str]:
    """A fingerprinted output's evidence, from its fields: the exact sampled elements and the
    sketch's estimate (docs/fingerprint.md). No mismatch count: a fingerprint cannot give one."""
    out = []
    rms = leaf.estimate == "rms"
    n = leaf.numel
    est, bound = leaf.estimated_l2, leaf.l2_bound
    if est is not None and bound is not None:
        if rms and n:
            text = f"estimated RMS error {est / math.sqrt(n):.2e}, allowance {bound / math.sqrt(n):.2e} (sketch)"
        else:
            text = f"estimated ||diff||_2 {est:.2e}, bound {bound:.2e} (sketch)"
        if leaf.sketch_rows:
            thr = leaf.l2_threshold
            shown = "-" if thr is None else f"{thr / math.sqrt(n) if rms and n else thr:.2e}"
            text += f"; {leaf.sketch_rows_over} of {leaf.sketch_rows} rows over the threshold {shown}"
        out.append(f"  fingerprint   : {text}")
    if leaf.sampled:
        line = f"  samples       : {leaf.mismatched} of {leaf.sampled} sampled elements outside tolerance"
        if leaf.mismatched and leaf.index is not None:
            gv, lv = fmt_pair(leaf.golden_value, leaf.live_value)
            line += f"; first at index {tuple(leaf.index)}: golden {gv}, live {lv}"
        out.append(line)
    if leaf.rtol is not None and leaf.atol is not None:
        out.append(f"  tolerance     : rtol={leaf.rtol:g}, atol={leaf.atol:g} ({leaf.tolerance_source})")
    if leaf.error_multiple is not None:
        out.append(f"  error / noise : ~{leaf.error_multiple:.3g}x the calibrated allowance (estimate; fails above 1)")
    if leaf.false_alarm is not None:
        certain = leaf.fingerprint_check not in (None, "sketch")
        out.append("  evidence      : " + (
            "certain (a fingerprint check that no within-tolerance run can fail)" if certain else
            f"an estimate: a run within tolerance fails the sketch check with probability <= {leaf.false_alarm:.1g}"
            if leaf.fingerprint_check == "sketch" else
            "estimates; a pass does not prove every element is within tolerance"))
    return out
