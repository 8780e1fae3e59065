"""Heatmaps of a divergence: |live - golden|, golden and live, from a ``Where``'s grid.

One small PNG per output (three panels side by side), read from the verdict's fields
(``LeafResult.where.heat``), so a report read back from JSON draws the same picture (callers:
``visual.heat_png``, which supplies matplotlib or says how to install it). The colour
scale is stated on each colour bar; the tolerance is marked on the |d| bar (the ``atol`` line)
and cells holding a mismatched element are outlined. matplotlib is the optional ``plot`` extra.
"""

from __future__ import annotations

import io
import os
from typing import Any

from ..results import Heat

DPI = 64


def render_heat_png(heat: Heat, mpl: tuple[Any, Any], *, title: str, rtol: float | None = None,
                    atol: float | None = None, golden_only: bool = False) -> bytes:
    """The picture: |live - golden| (max per cell), golden and live (mean per cell), or the
    golden alone (``golden_only``: a golden without a live run, as ``inspect --plot`` draws it)."""
    import numpy as np

    figure_cls, canvas_cls = mpl  # (Figure, FigureCanvasAgg)
    panels: list[tuple[str, Any, str]] = []
    if not golden_only:
        panels.append(("|live - golden| (max per cell)", np.asarray(heat.diff, dtype=float), "magma"))
    g = np.asarray(heat.golden, dtype=float)
    lv = np.asarray(heat.live, dtype=float)
    lim = float(np.nanmax(np.abs(np.concatenate([g.ravel(), lv.ravel()])))) or 1.0
    panels.append(("golden (mean per cell)", g, "coolwarm"))
    if not golden_only:
        panels.append(("live (mean per cell)", lv, "coolwarm"))
    fig = figure_cls(figsize=(3.3 * len(panels), 3.0), dpi=DPI)
    canvas_cls(fig)
    for i, (name, data, cmap) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if cmap == "magma":
            im = ax.imshow(data, cmap=cmap, aspect="auto", interpolation="nearest", vmin=0.0)
            bad = np.asarray(heat.bad, dtype=float)
            if bad.any() and min(bad.shape) > 1:
                ax.contour(bad, levels=[0.5], colors="cyan", linewidths=0.8)
            cb = fig.colorbar(im, ax=ax, fraction=0.05)
            cb.set_label("linear, 0 to max", fontsize=7)
            if atol is not None and data.size and float(data.max()) >= atol > 0:
                cb.ax.axhline(atol, color="cyan", linewidth=1.2)
        else:
            im = ax.imshow(data, cmap=cmap, aspect="auto", interpolation="nearest", vmin=-lim, vmax=lim)
            cb = fig.colorbar(im, ax=ax, fraction=0.05)
            cb.set_label(f"linear, +-{lim:.3g}", fontsize=7)
        cb.ax.tick_params(labelsize=6)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel(heat.cols, fontsize=7)
        ax.set_ylabel(heat.rows, fontsize=7)
        ax.tick_params(labelsize=6)
    tol = "" if golden_only or atol is None else (
        f"; tolerance atol={atol:g} + rtol={rtol or 0:g}*|golden| (cyan: atol on the |d| scale, "
        f"cells holding a mismatch outlined)")
    how = heat.reduced.replace("max |d| and mean value", "mean value") if golden_only else heat.reduced
    fig.suptitle(f"{title}\n{how}{tol}", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def write_heat(png: bytes, path: str | os.PathLike[str]) -> str:
    """Write a PNG atomically (a temporary file beside it, then a rename)."""
    p = os.fspath(path)
    tmp = f"{p}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(png)
    os.replace(tmp, p)
    return p
