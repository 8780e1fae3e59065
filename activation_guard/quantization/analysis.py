"""Per-layer sensitivity of a quantized (or otherwise compressed) model against its float golden.

A compare with ``replay="all"`` measures, per module call, two errors against the float golden:
the *accumulated* one (its live output) and its *own* one (the module re-run on the golden's
float inputs, its children returning the golden's outputs: only what this module's own
computation loses). After quantization every layer differs, so the first divergence says
nothing; the own error says which layers lose signal themselves, and which only inherit it.

The ranking is by own error (the chosen metric; SQNR by default). ``error_share`` estimates the
share of the model output's error each call's own error explains, from numbers the compare
measured, under a first-order model: a relative error ``r = dd / gg`` made by a call (its own
noise ratio, ``10^(-own SQNR / 10)``: :mod:`activation_guard._core.metrics`) reaches its parent's
output scaled by the call's share of that output's signal, ``min(1, gg_call / gg_parent)`` (a
branch added to a residual stream much larger than itself is damped by that ratio; a call that
makes its parent's output passes its error on whole), and so on up to the model's output
(``reach``, the product over the call's ancestors). The share is ``r x reach`` over the sum of
that over every call. Relative errors are taken to add up at the output (independent errors), and
gains of the computation between a call and its parent are ignored: an approximation, which is
why the advice can be checked in closed loop (:class:`ClosedLoop`): quantize again without the
advised modules and measure the end-to-end SQNR gained, beside keeping as many random ones and
the last ones.

Keep-in-float advice: the fewest modules, by largest summed share first, whose shares add up to
at least ``explain`` (0.9 by default) of the total; only modules that were compressed (a
parameter that is a tensor subclass, such as torchao's ``Int8Tensor``, or of a reduced floating
or integer dtype) are advised, and modules with float parameters that were left alone are named
as such rather than judged as quantized.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.metrics import HIGHER_IS_BETTER, Energy, Metric
from ..options.selection import matches
from ..results import LayerResult


@dataclass
class SensitivityRow:
    """One module call: its accumulated and own SQNR (dB), its share of the output's error (own
    noise ratios, normalized), and the chosen metric's values when it is not SQNR."""

    name: str
    call: int
    type_name: str = ""
    sqnr_db: float | None = None  # its output against the golden (accumulated)
    own_sqnr_db: float | None = None  # re-run on the golden's inputs (its own error); None: not replayed
    error_share: float = 0.0
    quantized: bool | None = None  # None: not known (a graph without modules)
    position: int | None = None  # in execution order
    value: float | None = None  # the chosen metric, accumulated
    own_value: float | None = None  # the chosen metric, own
    own_noise_ratio: float | None = None  # dd / gg of its own error
    reach: float = 1.0  # how much of its relative error reaches the model's output (module docstring)

    def to_dict(self) -> dict[str, Any]:
        return {k: _json(v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SensitivityRow:
        kw = {k: _unjson(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**kw)


@dataclass
class ClosedLoop:
    """The advice checked: the end-to-end SQNR (dB) of the model quantized again without the ``k``
    advised modules, without ``k`` random ones (median of ``draws``), and without the last ``k``;
    each gain is against the model quantized again with every module (``baseline_sqnr_db``)."""

    k: int
    advised: list[str]
    baseline_sqnr_db: float
    advised_sqnr_db: float
    random_sqnr_db: float  # the median over the draws
    last: list[str]
    last_sqnr_db: float
    random_draws: list[float] = field(default_factory=list)

    @property
    def advised_gain_db(self) -> float:
        return self.advised_sqnr_db - self.baseline_sqnr_db

    @property
    def random_gain_db(self) -> float:
        return self.random_sqnr_db - self.baseline_sqnr_db

    @property
    def last_gain_db(self) -> float:
        return self.last_sqnr_db - self.baseline_sqnr_db

    @property
    def worth_it(self) -> bool:
        """The advice gains more than keeping as many random modules (median) and the last ones."""
        return self.advised_gain_db > self.random_gain_db and self.advised_gain_db > self.last_gain_db

    def to_dict(self) -> dict[str, Any]:
        d = {k: _json(v) for k, v in self.__dict__.items()}
        d["random_draws"] = [_json(v) for v in self.random_draws]
        d.update(advised_gain_db=_json(self.advised_gain_db), random_gain_db=_json(self.random_gain_db),
                 last_gain_db=_json(self.last_gain_db), worth_it=self.worth_it)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClosedLoop:
        kw = {k: _unjson(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        kw["random_draws"] = [_unjson(v) for v in d.get("random_draws") or []]
        return cls(**kw)


def accumulated(layer: LayerResult) -> Energy | None:
    """What a call's output accumulated (under ``replay="all"`` a call judged by its own error keeps
    its output's energy as ``inherited_energy``)."""
    return layer.inherited_energy if layer.inherited_status is not None else layer.energy


def rows_of(layers: Iterable[LayerResult], metric: Metric, compressed: set[str] | None) -> list[SensitivityRow]:
    """One row per forward module call that was measured, ranked by own error (largest first;
    calls that could not be replayed last), with error shares (module docstring)."""
    rows = []
    signal: dict[str, list[float]] = {}  # module -> its calls' output energies in the golden
    for layer in layers:
        if layer.phase != "forward" or layer.position is None:
            continue
        acc, own = accumulated(layer), layer.own_energy
        if acc is None and own is None:
            continue
        gg = (acc if acc is not None else own).gg  # type: ignore[union-attr]
        signal.setdefault(layer.name, []).append(gg)
        rows.append(SensitivityRow(
            layer.name, layer.call, layer.type_name, None if acc is None else acc.sqnr_db(),
            None if own is None else own.sqnr_db(), quantized=None if compressed is None else layer.name in compressed,
            position=layer.position, value=None if acc is None else acc.value(metric),
            own_value=None if own is None else own.value(metric), own_noise_ratio=None if own is None
            else own.noise_ratio()))
    mean = {n: sum(v) / len(v) for n, v in signal.items()}
    weights = []
    for r in rows:
        r.reach = reach(r.name, mean)
        nr = r.own_noise_ratio
        weights.append(None if nr is None else (math.inf if not math.isfinite(nr) else nr * r.reach))
    finite = [w for w in weights if w is not None and math.isfinite(w)]
    total = sum(finite)
    for r, w in zip(rows, weights):
        if w is not None:
            r.error_share = 1.0 if not math.isfinite(w) else (w / total if total > 0 else 0.0)
    return sorted(rows, key=lambda r: _rank_key(r, metric))


def reach(name: str, signal: dict[str, float]) -> float:
    """The product over a module's ancestors of its (and then each ancestor's) share of the signal
    of the ancestor above, at most 1 each: how much of its relative error reaches the model's
    output under the first-order model of the module docstring. ``signal``: module -> the golden
    energy of its output (mean over calls)."""
    out = 1.0
    child = name
    while child:
        parent = child.rpartition(".")[0]
        while parent and parent not in signal:  # a container that was not measured: the one above it
            parent = parent.rpartition(".")[0]
        c, p = signal.get(child), signal.get(parent)
        if c is not None and p is not None and p > 0:
            out *= min(1.0, c / p)
        child = parent
    return out


def _rank_key(r: SensitivityRow, metric: Metric) -> tuple[int, float, int]:
    if r.own_value is None or math.isnan(r.own_value):
        return (1, 0.0, r.position or 0)
    v = r.own_value
    return (0, v if metric in HIGHER_IS_BETTER else -v, r.position or 0)  # largest error first


def shares_by_module(rows: Sequence[SensitivityRow]) -> dict[str, float]:
    """Each module's share summed over its calls (a module kept in float is kept for every call)."""
    out: dict[str, float] = {}
    for r in rows:
        out[r.name] = out.get(r.name, 0.0) + r.error_share
    return out


def advise(rows: Sequence[SensitivityRow], *, explain: float = 0.9, keep: int | None = None) -> list[str]:
    """The modules to keep in float: among compressed ones (all measured ones when that is not
    known), largest summed share first, the fewest whose shares reach ``explain`` of the total
    share of those candidates, or the first ``keep`` of them."""
    known = any(r.quantized is not None for r in rows)
    candidates = {r.name for r in rows if (r.quantized if known else r.name != "") and r.own_noise_ratio is not None}
    shares = {n: s for n, s in shares_by_module(rows).items() if n in candidates}
    first: dict[str, int] = {}
    for r in rows:
        first[r.name] = min(first.get(r.name, r.position or 0), r.position or 0)
    order = sorted(shares, key=lambda n: (-shares[n], first[n]))
    if keep is not None:
        return order[:keep]
    total = sum(shares.values())
    if total <= 0:
        return []
    out, acc = [], 0.0
    for n in order:
        if acc >= explain * total:
            break
        out.append(n)
        acc += shares[n]
    return out


def compressed_modules(model: torch.nn.Module) -> tuple[dict[str, str], list[str]]:
    """Modules whose own parameters were compressed (name -> how), and those holding float32/float64
    parameters left as they were (the modules a quantizer skipped)."""
    done: dict[str, str] = {}
    left: list[str] = []
    for name, m in model.named_modules():
        params = list(m.named_parameters(recurse=False))
        if not params:
            continue
        how = next((desc for _, p in params if (desc := _compressed(p)) is not None), None)
        if how is not None:
            done[name] = how
        else:
            left.append(name)
    return done, left


def _compressed(p: torch.Tensor) -> str | None:
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        return type(p).__name__
    if p.dtype not in (torch.float32, torch.float64):
        return str(p.dtype).replace("torch.", "")
    return None


def keep_globs(names: Sequence[str], all_names: Sequence[str]) -> list[str]:
    """``names`` as globs: modules differing only in their numeric components (``layers.0.mlp`` and
    ``layers.1.mlp``) become one ``layers.*.mlp`` where every module that glob matches is advised."""
    chosen = set(names)
    out: list[str] = []
    done: set[str] = set()
    for n in names:
        if n in done:
            continue
        glob = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n)
        group = [x for x in all_names if matches(x, glob) and x.count(".") == n.count(".")]
        if glob != n and len(group) > 1 and all(x in chosen for x in group):
            out.append(glob)
            done.update(group)
        else:
            out.append(n)
            done.add(n)
    return out


def draw_random(candidates: Sequence[str], k: int, draws: int, seed: int) -> list[list[str]]:
    """``draws`` random choices of ``k`` of ``candidates`` (seeded: the same on every run)."""
    rng = random.Random(seed)
    k = min(k, len(candidates))
    return [rng.sample(list(candidates), k) for _ in range(draws)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def _json(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _unjson(v: Any) -> Any:
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    return v
