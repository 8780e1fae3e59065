"""``activation-guard``: the command line (also ``python -m activation_guard``).

Commands::

    activation-guard demo [--out DIR] [--bug NAME]      record, break, compare: see it work
    activation-guard inspect GOLDEN.h5 [--layer GLOB] [--json] [--plot LAYER FILE.png]
    activation-guard diff A.h5 B.h5 [--rtol R] [--atol A] [--tolerances FILE.json]
                                    [--json] [--plot FILE.png] [--html FILE.html]
                                    [--heatmap LAYER FILE.png]
    activation-guard onnx MODEL.onnx GOLDEN.h5 [--optimization off|basic|default] [--calibrated]
                                    [--rtol R] [--atol A] [--tolerances FILE.json] [--json] [--html FILE.html]
    activation-guard textconv GOLDEN.h5                 for git's diff driver
    activation-guard verify GOLDEN.h5...                every stored value against its checksum

Exit status: 0 success (``diff``, ``onnx``: the values match), 1 ``diff`` or ``onnx`` found a divergence (or
``inspect --layer`` matched nothing), 2 usage error or an unusable (damaged) file. File errors are one
line on stderr, never a traceback: the golden errors already name the file and the fix.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ._core.errors import UPDATE_HINT, GoldenError, OptionError
from ._version import __version__
from .store.naming import is_hdf5_file

if TYPE_CHECKING:
    from .options.spec import Option

PROG = "activation-guard"


class CliError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


# --------------------------------------------------------------------------- helpers


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _dump_json(obj: Any) -> None:
    _out(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=str))


def load_tolerances(path: str) -> dict[str, Any]:
    """Read a ``--tolerances`` file: a JSON object of layer glob -> {"rtol": .., "atol": ..}
    (or an [rtol, atol] pair), exactly what ``compare(tolerances=...)`` takes."""
    where = f"tolerances file {path}"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise CliError(f"{where}: does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{where}: cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CliError(f"{where}: is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CliError(f'{where}: must hold a JSON object like {{"encoder.*": {{"rtol": 1e-4, "atol": 1e-5}}}}, '
                       f"got a {type(data).__name__}")
    return data  # its values are validated with every other option, by the spec


def _check_writable(path: str | None, option: str, inputs: tuple[str, ...] = ()) -> None:
    """An output file may be written: its folder exists, and it is neither a folder, nor one of
    the command's inputs, nor any other HDF5 file (a golden is never overwritten by a report)."""
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(d):
        raise CliError(f"{option} {path}: folder {d} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a folder; give a file name")
    for given in inputs:
        if os.path.abspath(given) == os.path.abspath(path) or (
                os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path)):
            raise CliError(f"{option} {path}: is another file of this command (an input or the other output); "
                           f"give another file name")
    if is_hdf5_file(path):
        raise CliError(f"{option} {path}: is an HDF5 file (a golden?), which a report never overwrites; give another "
                       f"file name")


# --------------------------------------------------------------------------- commands


def _output_change(ref: Any, new: Any) -> tuple[float | None, bool]:
    """How far the demo's final output moved, and whether a loose end-to-end check notices."""
    import torch

    if not isinstance(ref, torch.Tensor) or not isinstance(new, torch.Tensor) or ref.shape != new.shape:
        return None, False
    return float((new - ref).abs().max()), bool(torch.allclose(new, ref, rtol=1e-3, atol=1e-3))


def cmd_demo(args: argparse.Namespace) -> int:
    from .api.demo import BUGS, run_demo

    keep = args.out is not None
    if keep and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out}: is a file; give a folder (it is created if needed)")
    out_dir = args.out if keep else tempfile.mkdtemp(prefix="activation_guard-demo-")
    try:
        bug = BUGS[args.bug]
        _out(f"activation_guard demo: a tiny transformer ({PROG} demo --bug {bug.name})")
        try:
            res = run_demo(out_dir, bug.name, seed=args.seed)
        except OSError as e:
            raise CliError(f"--out {out_dir}: cannot write there ({e.strerror or e})") from None
        n = res.baseline.live_count
        _out(f"  1. recorded the reference model's {n} layer calls to {res.golden}")
        _out(f"  2. re-ran the unchanged model against it: {'OK' if res.baseline.ok else 'NOT OK (unexpected)'}")
        _out(f"  3. refactor bug injected: {bug.description}")
        moved, loose_ok = _output_change(res.baseline.output, res.report.output)
        if moved is not None:
            verdict = "passes" if loose_ok else "fails"
            _out(f"     the final output moved by at most {moved:.2e}; an end-to-end "
                 f"torch.allclose(rtol=1e-3, atol=1e-3) {verdict}")
        _out("  4. compared the refactored model layer by layer against the golden:")
        _out("")
        _out(str(res.report))
        _out("")
        if not res.worked:
            fd = res.report.first_divergence
            got = "no divergence" if fd is None else f"the first divergence at {fd.label}"
            _out(f"demo FAILED: expected the first divergence at {bug.layer!r}, got {got}")
            return 1
        _out(f"demo OK: the injected bug was found at {bug.layer!r}.")
        if keep:
            _out(f"The goldens are in {out_dir}; try:\n"
                 f"  {PROG} inspect {res.golden} --layer 'blocks.1.*'\n"
                 f"  {PROG} diff {res.golden} {res.refactored} --html report.html")
        else:
            _out(f"(pass --out DIR to keep golden.h5 and refactored.h5 and try `{PROG} inspect` / "
                 f"`{PROG} diff` on them)")
        return 0
    finally:
        if not keep:
            shutil.rmtree(out_dir, ignore_errors=True)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .report.inspect_text import format_inspect
    from .report.inspection import inspect_golden

    layer = args.layer or None
    if args.plot:
        _inspect_plot(args.golden, *args.plot)
    gi = inspect_golden(args.golden, layer)
    if args.json:
        _dump_json(gi.to_dict())
    else:
        shown = layer[0] if layer and len(layer) == 1 else layer
        _out(format_inspect(gi, shown))
    for line in gi.damaged:  # stored inputs the table does not show: damage there is an unusable file too
        print(f"{PROG}: error: {' '.join(line.split())}", file=sys.stderr)
    if gi.damaged:
        return 2
    return 1 if layer and not gi.leaves else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .report.inspection import verify_values
    from .store import GoldenReader

    bad = 0
    for path in args.golden:
        try:
            with GoldenReader(path) as reader:
                n, damaged = verify_values(reader)
        except GoldenError as e:  # its index, meta or layout: the file cannot be read at all
            print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
            bad += 1
            continue
        for line in damaged:
            print(f"{PROG}: error: {' '.join(line.split())}", file=sys.stderr)
        if damaged:
            bad += 1
            _out(f"{path}: DAMAGED, {len(damaged)} of {n + len(damaged)} stored values fail their checks")
        else:
            _out(f"{path}: OK, {n} stored values and the index pass their checks")
    return 2 if bad else 0
def _inspect_plot(golden: str, layer: str, path: str) -> None:
    """``inspect --plot LAYER FILE.png``: the golden's values of LAYER as a heatmap."""
    from .report.heatmap import write_heat
    from .report.inspection import golden_heat
    from .report.visual import _matplotlib, golden_png

    _check_writable(path, "--plot", (golden,))
    _matplotlib()  # fail before the work, with the install hint
    try:
        label, heat = golden_heat(golden, layer)
    except ValueError as e:
        raise CliError(f"--plot {layer}: {e}") from None
    try:
        write_heat(golden_png(label, heat), path)
    except OSError as e:
        raise CliError(f"cannot write --plot {path}: {e.strerror or e}") from None
    print(f"heatmap of the golden's {label} written to {path}", file=sys.stderr)


def cmd_diff(args: argparse.Namespace) -> int:
    from .api.diff import diff_recordings
    from .options.spec import CompareSpec

    heat_layer, heat_file = args.heatmap or (None, None)
    values, sources = option_values(args, "compare")
    if heat_layer is not None:
        values["where"], sources["where"] = [heat_layer], "--heatmap"
    spec = CompareSpec.build(values, sources)
    if not os.path.exists(args.b):  # not "golden ...: re-record the golden": B is the recording being checked
        raise CliError(f"recording {args.b}: file does not exist (the recording to check against the golden "
                       f"{args.a}; write it with activation_guard.record)")
    _check_writable(args.plot, "--plot", (args.a, args.b))
    _check_writable(args.html, "--html", (args.a, args.b, *((args.plot,) if args.plot else ())))
    _check_writable(heat_file, "--heatmap", (args.a, args.b, *(x for x in (args.plot, args.html) if x)))
    if args.plot or heat_file:
        from .report.visual import _matplotlib

        _matplotlib()  # fail before the work, with the install hint
    try:
        report = diff_recordings(args.a, args.b, spec=spec)
    except ValueError as e:  # e.g. --include matching no layer
        raise CliError(str(e)) from None
    except GoldenError as e:
        if os.path.abspath(e.path) != os.path.abspath(args.b):
            raise
        # B is the recording being checked, not a golden to re-record
        fix = f"; to fix: {e.fix}" if e.fix and e.fix != UPDATE_HINT else ""  # (git lfs pull, not re-record)
        raise CliError(f"recording {args.b}: {e.problem} (the recording to check against the golden "
                       f"{args.a}){fix}") from None
    if args.json:
        d = report.to_dict()
        d["other"] = args.b
        _dump_json(d)
    else:
        _out(str(report))
    if args.plot or args.html:
        from .report.visual import plot_available, write_html, write_plot

        msgs = []
        writing = ""
        try:
            if args.plot:
                writing = f"--plot {args.plot}"
                write_plot(report, args.plot)
                msgs.append(f"plot written to {args.plot}")
            if args.html:
                writing = f"--html {args.html}"
                write_html([(f"{args.b} vs golden {args.a}", report)], args.html,
                           title=f"activation_guard diff: {os.path.basename(args.b)} vs {os.path.basename(args.a)}")
                msgs.append(f"HTML report written to {args.html}"
                            + ("" if plot_available() else " (without plot: matplotlib is not installed)"))
        except OSError as e:
            raise CliError(f"cannot write {writing}: {e.strerror or e}") from None
        for m in msgs:
            print(m, file=sys.stderr)
    if heat_file:
        _write_heatmap(report, str(heat_layer), heat_file)
    return 0 if report.ok else 1


# the table's options an ONNX Runtime compare takes (a metric, heatmaps and renames are eager-only)
ONNX_OPTIONS = ("rtol", "atol", "tolerances", "include", "exclude", "allow_dtype_change")


def cmd_onnx(args: argparse.Namespace) -> int:
    from ._core.errors import UnsupportedModelError
    from .api.runtime import compare_onnx_spec
    from .options.spec import CompareSpec

    values, sources = option_values(args, "compare", ONNX_OPTIONS)
    if args.calibrated:
        values["tolerance"], sources["tolerance"] = "calibrated", "--calibrated"
    spec = CompareSpec.build(values, sources)
    _check_writable(args.html, "--html", (args.model, args.golden))
    try:
        report = compare_onnx_spec(args.model, path=args.golden, spec=spec, optimization=args.optimization)
    except (UnsupportedModelError, ValueError) as e:
        raise CliError(str(e)) from None
    if args.json:
        d = report.to_dict()
        d["onnx_model"] = args.model
        _dump_json(d)
    else:
        _out(str(report))
    if args.html:
        from .report.visual import write_html

        try:
            write_html([(f"{args.model} in ONNX Runtime vs golden {args.golden}", report)], args.html,
                       title=f"activation_guard onnx: {os.path.basename(args.model)} vs "
                             f"{os.path.basename(args.golden)}")
        except OSError as e:
            raise CliError(f"cannot write --html {args.html}: {e.strerror or e}") from None
        print(f"HTML report written to {args.html}", file=sys.stderr)
    return 0 if report.ok else 1


def _write_heatmap(report: Any, layer: str, path: str) -> None:
    """``diff --heatmap LAYER FILE.png``: the named layer's first described diverged output."""
    from .options.selection import display_name
    from .report.heatmap import write_heat
    from .report.visual import heat_png

    found = [(x, leaf) for x, leaf in report.described() if leaf.where is not None and leaf.where.requested]
    if not found:
        named = [x for x in report.layers if fnmatch.fnmatchcase(x.name, layer) or display_name(x.name) == layer]
        why = ("no layer matches it" if not named else
               "it matches the recordings there" if all(x.ok for x in named) else
               "its diverged outputs hold no values compared in full (fingerprints or non-tensor outputs)")
        raise CliError(f"--heatmap {layer}: no heatmap to draw: {why}")
    x, leaf = found[0]
    png = heat_png(x.label, leaf)
    assert png is not None
    try:
        write_heat(png, path)
    except OSError as e:
        raise CliError(f"cannot write --heatmap {path}: {e.strerror or e}") from None
    print(f"heatmap of {x.label} written to {path}", file=sys.stderr)


def cmd_sensitivity(args: argparse.Namespace) -> int:
    from .report.sensitivity import SensitivityReport

    try:
        with open(args.report, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise CliError(f"sensitivity report {args.report}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise CliError(f"sensitivity report {args.report}: not a sensitivity report (no 'rows' list); write one "
                       f"with SensitivityReport.to_json()")
    report = SensitivityReport.from_dict(data)
    if args.html:
        _check_writable(args.html, "--html", (args.report,))
        report.write_html(args.html)
    _out(str(report))
    return 1 if report.closed_loop is not None and not report.closed_loop.worth_it else 0


def cmd_textconv(args: argparse.Namespace) -> int:
    from .report.inspect_text import textconv_lines

    for line in textconv_lines(args.golden):
        sys.stdout.write(line + "\n")
    return 0


# --------------------------------------------------------------------------- parser


Side = Literal["record", "compare"]


def _cli_options(side: Side, names: Collection[str] | None) -> list[tuple[str, Option]]:
    """(flag, row) of each option of ``side`` the command line takes, in the table's order."""
    from .options.spec import OPTIONS

    return [(o.cli, o) for o in OPTIONS.values()
            if o.cli is not None and getattr(o, side) and (names is None or o.name in names)]


def add_option_flags(parser: argparse.ArgumentParser, side: Side, names: Collection[str] | None = None) -> None:
    """The command-line flags of the options of ``side`` that have one (``Option.cli``), from the
    option table: its help text, metavar and how the flag gives a value. ``names``: only these
    options (a command that takes some of them)."""
    for flag, o in _cli_options(side, names):
        if o.flag_takes == "switch":
            parser.add_argument(flag, dest=o.name, action="store_true", help=o.cli_help())
        else:
            parser.add_argument(flag, dest=o.name, metavar=o.flag_metavar, help=o.cli_help(),
                                action="append" if o.flag_takes == "values" else "store")


def option_values(args: argparse.Namespace, side: Side,
                  names: Collection[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The options :func:`add_option_flags` added, as given (unset ones left out), and the flag
    that set each (its source in error messages); a file-valued flag's JSON is read here."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag, o in _cli_options(side, names):
        v = getattr(args, o.name, None)
        if v is None or v is False or v == []:
            continue
        values[o.name] = load_tolerances(v) if o.from_file else v
        sources[o.name] = f"{flag} {v}" if o.from_file else flag
    return values, sources


def build_parser() -> argparse.ArgumentParser:
    from .api.demo import BUGS

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Layer-by-layer activation goldens for PyTorch models: demo, inspect, diff, onnx, textconv, "
                    "sensitivity, verify.",
        epilog="Exit status: 0 ok, 1 diff or onnx found a divergence, 2 usage error or unusable file.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", help="record a built-in model, inject a refactor bug, and find it",
                       description="Record goldens from a tiny transformer, inject a realistic refactor bug, "
                                   "compare, and print the first-divergence report. Exit 0 when the bug is found.")
    d.add_argument("--out", metavar="DIR", help="keep golden.h5 and refactored.h5 in DIR (default: a temporary folder)")
    d.add_argument("--bug", choices=sorted(BUGS), default="layernorm-eps",
                   help="which bug to inject (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="show a golden's metadata and per-output statistics",
                       description="Metadata (versions, device, model class, input fingerprint, numerics flags) and "
                                   "a table in execution order: layer, call, output path, dtype, shape, min, max, "
                                   "mean, std and non-finite count.")
    i.add_argument("golden", metavar="GOLDEN.h5")
    i.add_argument("--layer", metavar="GLOB", action="append", help="only layers whose name matches (repeatable)")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--plot", nargs=2, metavar=("LAYER", "FILE.png"),
                   help="write a heatmap of LAYER's stored values, reduced to 2-D as diff --heatmap does "
                        "(needs matplotlib)")
    i.set_defaults(func=cmd_inspect)

    f = sub.add_parser("diff", help="compare two recordings with the compare engine (exit 1 if they diverge)",
                       description="Compare recording B against golden A layer by layer, exactly as a live compare "
                                   "would (same tolerances, including cross-device defaults; same report).")
    f.add_argument("a", metavar="A.h5", help="the golden (reference)")
    f.add_argument("b", metavar="B.h5", help="the recording checked against it")
    add_option_flags(f, "compare")
    f.add_argument("--json", action="store_true", help="machine-readable report")
    f.add_argument("--plot", metavar="FILE.png", help="write the error-by-layer plot (needs matplotlib)")
    f.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML report")
    f.add_argument("--heatmap", nargs=2, metavar=("LAYER", "FILE.png"),
                   help="write the heatmap of |B - A|, A and B for LAYER's first diverged call, and describe where "
                        "it differs in the report (needs matplotlib)")
    f.set_defaults(func=cmd_diff)

    o = sub.add_parser("onnx", help="run an ONNX model in ONNX Runtime and compare it per module with an eager golden "
                                    "(exit 1 if it diverges)",
                       description="Run MODEL.onnx (torch.onnx.export(..., dynamo=True)) in ONNX Runtime on the model "
                                   "inputs the golden recorded, and compare every module call whose values the ONNX "
                                   "graph names against the golden, with cross-runtime default tolerances. Needs "
                                   "pip install 'activation_guard[onnx]'.")
    o.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    o.add_argument("golden", metavar="GOLDEN.h5", help="the eager model's golden")
    o.add_argument("--optimization", choices=["off", "basic", "default"], default="off",
                   help="ONNX Runtime graph optimizations for the per-module run (default: %(default)s, a faithful "
                        "map); the model's outputs always come from a fully optimized run too")
    o.add_argument("--calibrated", action="store_true",
                   help="judge by the golden's noise floors (a golden recorded with calibrate=True)")
    add_option_flags(o, "compare", ONNX_OPTIONS)
    o.add_argument("--json", action="store_true", help="machine-readable report")
    o.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML report")
    o.set_defaults(func=cmd_onnx)

    t = sub.add_parser("textconv", help="stable line-per-output text of a golden, for git diff",
                       description="One line per output: layer[call], path, dtype, shape, sha256 prefix of the bytes, "
                                   "min/max/mean/std, non-finite count. Use as git's textconv diff driver.")
    t.add_argument("golden", metavar="GOLDEN.h5")
    t.set_defaults(func=cmd_textconv)

    s = sub.add_parser("sensitivity", help="show a saved sensitivity report (text, HTML); exit 1 if its advice failed",
                       description="Render a sensitivity report saved as JSON (SensitivityReport.to_json(), from "
                                   "activation_guard.sensitivity): the layers ranked by own error, the keep-in-float "
                                   "advice and its closed-loop check. Exit 1 when the closed loop found the advice "
                                   "worth no more than keeping random or the last modules.")
    s.add_argument("report", metavar="REPORT.json")
    s.add_argument("--html", metavar="FILE.html", help="write the self-contained HTML page (table and SQNR plot)")
    s.set_defaults(func=cmd_sensitivity)

    v = sub.add_parser("verify", help="check every stored value and index rule of goldens (exit 2 if damaged)",
                       description="Read every stored value of each golden (outputs, the calls' inputs, gradients, "
                                   "fingerprints) against its checksum, resolve every alias, and check the index "
                                   "and meta. Exit 2 naming each damaged value and its file.")
    v.add_argument("golden", metavar="GOLDEN.h5", nargs="+")
    v.set_defaults(func=cmd_verify)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    from .report.visual import PlotUnavailableError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (GoldenError, CliError, PlotUnavailableError, OptionError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `activation-guard textconv x.h5 | head`
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except OSError as e:  # writing the output failed (a full disk): not "diverged" (1)
        print(f"{PROG}: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
