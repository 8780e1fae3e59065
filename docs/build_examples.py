#!/usr/bin/env python3
"""Rebuild every example output block in README.md and docs/*.md from real runs.

    python docs/build_examples.py            # rewrite the blocks that drifted, in place
    python docs/build_examples.py --force    # rewrite every block (versions, digests and all)
    python docs/build_examples.py --check    # exit 1, with a diff, when a block no longer matches a real run
    python docs/build_examples.py --images   # also redraw docs/error-by-layer.png and docs/html-report.png

Documentation that shows output the code no longer prints is worse than none, so output is never
typed in: a generated block sits between two markers naming its example, a key of ``EXAMPLES``
below, which says which commands produce it::

    <!-- example: inspect-mlp -->
    ```text
    $ activation-guard inspect demo/golden.h5 --layer 'blocks.1.mlp*'
    ...
    ```
    <!-- /example -->

Each run happens in a fresh scratch folder that is the current directory: ``activation-guard demo
--out demo`` first (the goldens the other commands read), the CLI in this process (the same code
path as the console script, minus torch's import time per command), ``pytest -n 2`` and ``git
diff`` as real subprocesses. The package used is this checkout's (``sys.path`` and ``PYTHONPATH``).

Normalization, so that a block depends on the code and not on the machine or the moment. What is
written to the docs:

- the scratch folder prints as ``/path/to`` (``/path/to/project`` for the example pytest project);
  paths under it that the commands print relative stay relative;
- the demo's own temporary folder prints as ``/tmp/activation_guard-demo-XXXXXXXX``;
- durations (pytest's ``in 13.15s``) print as ``in X.XXs``; xdist's ``[gw0] linux -- Python ...``
  lines (which worker ran a test, and the interpreter's path) are dropped;
- torch uses one intra-op thread, so float sums run in one order whatever the core count; pytest
  gets an 80-column terminal;
- abridged blocks (marked ``...`` in the text) are cut at fixed lines by the example's code.

What ``--check`` compares, on top of that (versions and digests stay real in the docs, but a
docs check must not fail because CI has a newer h5py): version numbers (``2.13.0+cpu``, ``3.16.0``),
``sha256:`` digests, git's ``index`` blob ids, the CPU's ``device_name``, the ``platform`` and
``cuda`` version, and the worst element's index (near-ties go either way on another CPU; its rank
stays) are masked; runs of whitespace count as one space; whole numbers (counts, positions, sizes)
agree within 1% and measured ones (written with a point or an exponent) within 5%, or 5e-8
absolute: a largest relative difference is a maximum of ratios over tiny golden values, and
another CPU's vector units move it by a few percent (1.01e-02 here, 1.04e-02 on CI); that is not
drift, while a changed, added or removed line, word, count or column is.

Timings are not examples: where the docs state one, the prose names the machine it came from.
The benchmark output in docs/performance.md is recorded output of ``benchmarks/run.py`` (minutes
long, with its machine stated) and is not rebuilt here.

One file of about 500 lines on purpose: a script run from a checkout (``python docs/...``), whose
examples, cutting rules and normalization are read together when a block changes.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import math
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed copy

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /example -->", re.S)
ELIDED = "  ..."
PROJECT_TESTS = '''\
import torch

from activation_guard.api.demo import TinyTransformer

NORM_EPS = 1e-5  # what the refactor changes


def encoder():
    torch.manual_seed(0)
    model = TinyTransformer(depth=3).eval()
    model.blocks[1].norm2.eps = NORM_EPS
    return model


def head():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).eval()


def inputs(device):
    return (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).to(device),)


def test_encoder(activation_guard, ag_device):
    activation_guard.check(encoder().to(ag_device), inputs(ag_device))


def test_head(activation_guard, ag_device):
    activation_guard.check(head().to(ag_device), inputs(ag_device))
'''


WHY_SCRIPT = '''\
import copy

import torch
import torch.nn.functional as F

import activation_guard as ag

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(64, 4, 256, activation="gelu", batch_first=True).eval()
x = torch.randn(2, 10, 64)
ag.record(layer, x, path="golden.h5", calibrate=True)

refactored = copy.deepcopy(layer)  # the refactor: the same GELU, as its tanh approximation
refactored.activation = lambda t: F.gelu(t, approximate="tanh")
print(ag.compare(refactored, x, path="golden.h5"))

with ag.emulate_tf32():  # a GPU's TF32 matmuls, emulated on the CPU: every layer drifts
    print(ag.compare(refactored, x, path="golden.h5", tolerance="calibrated"))
    print(ag.compare(refactored, x, path="golden.h5", tolerance="calibrated", replay="all"))
'''


GRAPH_SCRIPT = '''\
import torch
from torch import nn
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

import activation_guard as ag


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.head = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))


torch.manual_seed(0)
model, x = Net().eval(), torch.randn(8, 16)
ag.record(model, x, path="eager.h5")

ep = torch.export.export(model, (x,))
torch.export.save(ep, "net.pt2")
print(ag.compare("net.pt2", x, path="eager.h5"))

gm = ep.module()  # a user pass: the second GELU call in its tanh form
for node in gm.graph.nodes:
    if node.target is torch.ops.aten.gelu.default and node.name == "gelu_1":
        node.kwargs = {"approximate": "tanh"}
gm.recompile()
print(ag.compare(gm, x, path="eager.h5"))

quantizer = xiq.X86InductorQuantizer()
quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
prepared(x)  # calibration
report = ag.compare(convert_pt2e(prepared), x, path="eager.h5", replay="all")
for r in report.layers:  # each module call's own error (its replay) beside the error it accumulated
    if r.name:
        print(f"{r.name:4} call {r.call}  accumulated {r.max_abs_diff:.2e}  own {r.own_max_abs_diff:.2e}")
'''


@contextlib.contextmanager
def cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
             COLUMNS="80", OMP_NUM_THREADS="1", GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
             GIT_PAGER="cat", LC_ALL="C")
    # pytest stops shortening summary lines when CI or BUILD_NUMBER is set; examples must read the same anywhere.
    for name in ("PYTEST_ADDOPTS", "CI", "BUILD_NUMBER"):
        e.pop(name, None)
    return e


def plugin_installed() -> bool:
    """Whether pytest loads the plugin by itself (the package is installed, with its entry point)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        eps = distribution("activation_guard").entry_points
    except PackageNotFoundError:
        return False
    return any(ep.group == "pytest11" and ep.value == "activation_guard.plugin" for ep in eps)


class Scratch:
    """The folder every example runs in, and the runs several examples share."""

    def __init__(self, path: Path):
        self.path = path
        self._cache: dict[str, str] = {}
        self._pytest: subprocess.Popen[str] | None = None

    def cli(self, *argv: str) -> tuple[int, str]:
        """``activation-guard ARGV`` in this process; stdout and stderr interleaved as a terminal shows them."""
        from activation_guard.cli import main

        buf = io.StringIO()
        with cwd(self.path), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = main(list(argv))
        return rc, buf.getvalue()

    def shown(self, *argv: str, expect: int = 0) -> str:
        rc, out = self.cli(*argv)
        if rc != expect:
            raise RuntimeError(f"activation-guard {shlex.join(argv)} exited {rc}, expected {expect}:\n{out}")
        return f"$ activation-guard {shlex.join(argv)}\n{out}"

    def once(self, key: str, make: Callable[[], str]) -> str:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def demo(self) -> str:
        return self.once("demo", lambda: self.shown("demo", "--out", "demo"))

    def start_pytest(self) -> None:
        """Record the example project's goldens, apply the refactor, start ``pytest -n 2`` in the background."""
        if self._pytest is not None:
            return
        import pytest

        project = self.path / "project"
        (project / "tests").mkdir(parents=True)
        (project / "pytest.ini").write_text("[pytest]\nag_golden_dir = golden\n")
        test_file = project / "tests" / "test_models.py"
        test_file.write_text(PROJECT_TESTS)
        plugin = [] if plugin_installed() else ["-p", "activation_guard.plugin"]
        dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # the file changes below
        try:
            with cwd(project), contextlib.redirect_stdout(io.StringIO()) as out:
                rc = pytest.main(["--ag-update", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *plugin])
        finally:
            sys.dont_write_bytecode = dont_write
        if rc != 0:
            raise RuntimeError(f"pytest --ag-update in the example project failed ({rc}):\n{out.getvalue()}")
        sys.modules.pop("test_models", None)
        test_file.write_text(PROJECT_TESTS.replace("NORM_EPS = 1e-5", "NORM_EPS = 0.001"))  # the refactor
        self._pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", *plugin],
                                        cwd=project, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)

    def pytest_output(self) -> str:
        self.start_pytest()
        assert self._pytest is not None
        out, _ = self._pytest.communicate(timeout=600)
        if self._pytest.returncode != 1:
            raise RuntimeError(f"pytest -n 2 in the example project exited {self._pytest.returncode}, "
                               f"expected 1:\n{out}")
        return out


# --------------------------------------------------------------------------- cutting


def between(text: str, first: str, last: str) -> list[str]:
    """The lines from the first one matching ``first`` to the next one matching ``last``, inclusive."""
    lines = text.splitlines()
    i = next(k for k, s in enumerate(lines) if re.search(first, s))
    j = next(k for k in range(i, len(lines)) if re.search(last, lines[k]))
    return lines[i:j + 1]


def elide(lines: list[str], after: str, resume: str | None = None, mark: str = ELIDED) -> list[str]:
    """Keep the lines up to the one matching ``after``, then ``mark``, then from ``resume`` (if any) on."""
    i = next(k for k, s in enumerate(lines) if re.search(after, s))
    out = [*lines[:i + 1], mark]
    if resume is not None:
        j = next(k for k in range(i + 1, len(lines)) if re.search(resume, lines[k]))
        out += lines[j:]
    return out


# --------------------------------------------------------------------------- the examples


def ex_demo(s: Scratch) -> str:
    return s.demo()


def ex_demo_report(s: Scratch) -> str:
    s.demo()
    rc, out = s.cli("demo")  # as the quick start runs it: goldens in a temporary folder
    assert rc == 0, out
    return "\n".join(between(out, r"^activation_guard: first divergence", r"^\s*totals:"))


def ex_demo_backward_report(s: Scratch) -> str:
    rc, out = s.cli("demo", "--bug", "gelu-backward")  # a backward-only bug: goldens with gradients
    assert rc == 0, out
    return "\n".join(between(out, r"^activation_guard: first divergence", r"^\s*totals:"))


def ex_inspect(s: Scratch) -> str:
    s.demo()
    return s.shown("inspect", "demo/golden.h5", "--layer", "blocks.1.*")


def ex_inspect_mlp(s: Scratch) -> str:
    s.demo()
    lines = s.shown("inspect", "demo/golden.h5", "--layer", "blocks.1.mlp*").splitlines()
    return "\n".join(elide(lines, r"^device\s*:", r"^\d+ layer calls", mark="..."))


def ex_diff(s: Scratch) -> str:
    s.demo()
    lines = s.shown("diff", "demo/golden.h5", "demo/refactored.h5", expect=1).splitlines()
    return "\n".join([*elide(lines, r"^\s*tolerance\s*:"), "$ echo $?", "1"])


def ex_diff_plot_html(s: Scratch) -> str:
    s.demo()
    out = s.shown("diff", "demo/golden.h5", "demo/refactored.h5", "--plot", "error-by-layer.png", "--html",
                  "report.html", expect=1)
    return "\n".join([*elide(out.splitlines(), r"^\s*tolerance\s*:", r"^\s*totals:"), "$ echo $?", "1"])


def ex_errors(s: Scratch) -> str:
    (s.path / "golden").mkdir(exist_ok=True)
    (s.path / "golden" / "encoder.h5").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 145623\n")
    (s.path / "notes.txt").write_text("not a golden\n")
    return s.shown("inspect", "golden/encoder.h5", expect=2) + s.shown("inspect", "notes.txt", expect=2)


def ex_git_diff(s: Scratch) -> str:
    s.demo()
    repo = s.path / "repo"
    (repo / "golden").mkdir(parents=True)

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-c", "user.name=docs", "-c", "user.email=docs@example.invalid",
                            "-c", "color.ui=never", *args], cwd=repo, env=env(), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"git {shlex.join(args)}: {r.stderr}")
        return r.stdout

    git("init", "-q")
    (repo / ".gitattributes").write_text("*.h5 diff=activation-guard\n")
    git("config", "diff.activation-guard.textconv", f"{shlex.quote(sys.executable)} -m activation_guard textconv")
    shutil.copy(s.path / "demo" / "golden.h5", repo / "golden" / "encoder.h5")
    git("add", ".")
    git("commit", "-q", "-m", "golden")
    shutil.copy(s.path / "demo" / "refactored.h5", repo / "golden" / "encoder.h5")
    lines = git("diff", "golden/encoder.h5").splitlines()
    first_plus = next(k for k, x in enumerate(lines) if x.startswith("+") and not x.startswith("+++"))
    minus = [k for k, x in enumerate(lines[:first_plus]) if x.startswith("-") and not x.startswith("---")]
    keep = lines[:minus[1] + 1] + lines[first_plus:first_plus + 2] + ["..."]  # two layers' lines, old and new
    return "\n".join(["$ git diff golden/encoder.h5", *keep])


def ex_pytest_failure(s: Scratch) -> str:
    out = s.pytest_output()
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if re.match(r"=+ FAILURES =+$", x))
    return "\n".join(["$ pytest -n 2", "...", *elide(lines[i:], r"^\s*tolerance\s*:", r"^\s*options in force")])


def ex_fingerprint(s: Scratch) -> str:
    """The README's fingerprint example: a wider demo transformer recorded with full values and
    with fingerprints, the eps bug, and the report against the fingerprints."""
    import copy

    import torch

    import activation_guard as ag
    from activation_guard.api.demo import BUGS, TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(dim=64).eval()
    x = 0.1 * torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))
    buggy = copy.deepcopy(model)
    BUGS["layernorm-eps"].apply(buggy)
    with cwd(s.path):
        full = ag.record(model, x, path="golden/full.h5")
        fp = ag.record(model, x, path="golden/encoder.h5", fingerprint=True)
        report = str(ag.compare(buggy, x, path="golden/encoder.h5"))
    lines = between(report, r"^activation_guard: first divergence", r"^\s*totals:")
    keep = [ln for ln in lines if not ln.startswith("  note:")]  # long notes, cut (marked below)
    return "\n".join([
        '>>> print(ag.record(model, x, path="golden/full.h5"))', str(full),
        '>>> print(ag.record(model, x, path="golden/encoder.h5", fingerprint=True))', str(fp),
        '>>> print(ag.compare(buggy, x, path="golden/encoder.h5"))', keep[0], ELIDED, *keep[1:]])


def ex_why(s: Scratch) -> str:
    """The script, run in this process in the scratch folder; the last report cut after its numbers."""
    (s.path / "why.py").write_text(WHY_SCRIPT)
    buf = io.StringIO()
    with cwd(s.path), contextlib.redirect_stdout(buf):
        runpy.run_path("why.py", run_name="__main__")
    lines = buf.getvalue().splitlines()
    last = max(k for k, x in enumerate(lines) if x.startswith("activation_guard: first divergence"))
    tail = elide(lines[last:], r"^\s*error / noise\s*:", r"^\s*totals:")
    return "\n".join(["$ cat why.py", *WHY_SCRIPT.splitlines(), "$ python why.py", *lines[:last], *tail])


def ex_graphs(s: Scratch) -> str:
    """The README's exported-program script: a .pt2 against the eager golden, a user pass, PT2E."""
    (s.path / "graphs.py").write_text(GRAPH_SCRIPT)
    buf = io.StringIO()
    with cwd(s.path), contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path("graphs.py", run_name="__main__")
    lines = buf.getvalue().splitlines()
    second = next(k for k, x in enumerate(lines) if x.startswith("activation_guard: first divergence"))
    return "\n".join(["$ python graphs.py", *lines[:second],
                      *elide(lines[second:], r"^\s*note:", r"^\s*context \(execution order\)")])


@dataclass(frozen=True)
class Example:
    run: Callable[[Scratch], str]
    lang: str = "text"
    background: bool = False  # starts a subprocess first, so it runs while the others do


EXAMPLES: dict[str, Example] = {
    "demo": Example(ex_demo),
    "demo-report": Example(ex_demo_report),
    "demo-backward-report": Example(ex_demo_backward_report),
    "inspect": Example(ex_inspect),
    "inspect-mlp": Example(ex_inspect_mlp),
    "diff": Example(ex_diff),
    "diff-plot-html": Example(ex_diff_plot_html),
    "errors": Example(ex_errors),
    "git-diff": Example(ex_git_diff, lang="diff"),
    "pytest-failure": Example(ex_pytest_failure, background=True),
    "fingerprint": Example(ex_fingerprint),
    "why-diverged": Example(ex_why),
    "exported-graphs": Example(ex_graphs),
}


# --------------------------------------------------------------------------- normalizing


def pytest_rule(line: str, width: int = 80) -> str:
    """A pytest ``==== title ====`` line re-centred as pytest draws it (the title's length changed)."""
    m = re.fullmatch(r"(=+) (.+?) =+", line)
    if m is None:
        return line
    fill = "=" * max((width - len(m[2]) - 2) // 2, 1)
    out = f"{fill} {m[2]} {fill}"
    return out + "=" if len(out) < width else out


def rel(page: Path) -> str:
    try:
        return str(page.relative_to(ROOT))
    except ValueError:
        return str(page)


def normalize(text: str, scratch: Path) -> str:
    """What is written to the docs (see the module docstring)."""
    text = text.replace(str(scratch) + os.sep, "/path/to/")
    tmp = re.escape(tempfile.gettempdir())
    text = re.sub(tmp + r"/activation_guard-demo-\w+", "/tmp/activation_guard-demo-XXXXXXXX", text)
    text = re.sub(r"\bin \d+(\.\d+)?s\b( \(\d+:\d\d:\d\d\))?", "in X.XXs", text)
    lines = [pytest_rule(x.rstrip()) for x in text.splitlines() if not re.match(r"\[gw\d+\] ", x)]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


VOLATILE = [
    (re.compile(r"\b\d+\.\d+\.\d+[\w.+-]*"), "<version>"),
    (re.compile(r"sha256:[0-9a-f]+"), "sha256:<digest>"),
    (re.compile(r"\bindex [0-9a-f]+\.\.[0-9a-f]+"), "index <blobs>"),
    (re.compile(r"device_name [^\s,)]+"), "device_name <cpu>"),
    (re.compile(r"\bplatform \w+"), "platform <os>"),
    (re.compile(r"\bcuda [^\s,]+"), "cuda <version>"),
    # where the worst element sits: among near-equal differences (a GELU's two forms differ most at
    # the same input value, wherever it occurs) the CPU's vector units pick which one is largest
    # (its rank stays: a column added or lost is drift)
    # (only the worst element's: "first at index" of a sample or a mismatch list is deterministic)
    (re.compile(r"(?<=\d) at index \([\d, ]*\)"), lambda m: re.sub(r"\d+", "i", m[0])),
]
NUMBER = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


class Number(float):
    """A number read from a block; ``measured`` when written with a point or an exponent."""

    measured: bool

    def __new__(cls, text: str) -> Number:
        n = super().__new__(cls, text)
        n.measured = any(c in text for c in ".eE")
        return n


def tokens(text: str) -> list[str | Number]:
    for pattern, mask in VOLATILE:
        text = pattern.sub(mask, text)
    out: list[str | Number] = []
    for k, part in enumerate(NUMBER.split(text)):
        out.append(Number(part) if k % 2 else " ".join(part.split()))
    return out


def same(a: str, b: str) -> bool:
    """Equal up to the volatile parts, whitespace, and each number's noise (module docstring)."""
    ta, tb = tokens(a), tokens(b)
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if isinstance(x, Number) and isinstance(y, Number):
            rel = 5e-2 if x.measured or y.measured else 1e-2
            if not math.isclose(x, y, rel_tol=rel, abs_tol=5e-8):
                return False
        elif x != y:
            return False
    return True


# --------------------------------------------------------------------------- pages


def fence(ex: Example, text: str) -> str:
    return f"```{ex.lang}\n{text}\n```\n"


def unfence(body: str) -> str:
    lines = body.strip("\n").splitlines()
    return "\n".join(lines[1:-1]) if len(lines) >= 2 and lines[0].startswith("```") else body


def used_examples(pages: list[Path]) -> list[str]:
    names: list[str] = []
    for page in pages:
        for m in MARKER.finditer(page.read_text(encoding="utf-8")):
            if m["name"] not in EXAMPLES:
                raise SystemExit(f"{rel(page)}: unknown example {m['name']!r}; known: {', '.join(EXAMPLES)}")
            if m["name"] not in names:
                names.append(m["name"])
    return names


def render(names: list[str], scratch: Scratch) -> dict[str, str]:
    import torch

    torch.set_num_threads(1)
    for name in names:
        if EXAMPLES[name].background:
            scratch.start_pytest()
    order = sorted(names, key=lambda n: EXAMPLES[n].background)  # wait for the background run last
    return {n: normalize(EXAMPLES[n].run(scratch), scratch.path) for n in order}


def update(pages: list[Path], outputs: dict[str, str], check: bool, force: bool = False) -> list[str]:
    """Rewrite the drifted blocks (every block with ``force``; none with ``check``); returns the
    drifted ones as diffs."""
    drift = []
    for page in pages:
        text = page.read_text(encoding="utf-8")

        def sub(m: re.Match[str], page: Path = page) -> str:
            ex, new = EXAMPLES[m["name"]], outputs[m["name"]]
            old = unfence(m["body"])
            if same(old, new) and not force:
                return m.group(0)  # current: keep it byte for byte (no churn from versions or last digits)
            if not same(old, new):
                diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "in the docs", "from a real run",
                                            lineterm="", n=1)
                drift.append(f"{rel(page)}: example {m['name']!r} drifted:\n" + "\n".join(diff))
            return f"<!-- example: {m['name']} -->\n{fence(ex, new)}<!-- /example -->"

        new_text = MARKER.sub(sub, text)
        if not check and new_text != text:
            page.write_text(new_text, encoding="utf-8")
            print(f"rewrote {rel(page)}")
    return drift


def images(scratch: Scratch) -> None:
    """docs/error-by-layer.png (the diff example's plot) and docs/html-report.png (its HTML page,
    1280x900 in headless Chromium, the first divergence centred)."""
    from PIL import Image

    sys.path.insert(0, str(ROOT / "tests"))
    from cdp import Browser, find_browser

    ex_diff_plot_html(scratch)
    shutil.copy(scratch.path / "error-by-layer.png", ROOT / "docs" / "error-by-layer.png")
    binary = find_browser()
    if binary is None:
        raise SystemExit("--images needs Chromium for the screenshot (apt-get install chromium, or set AG_CHROMIUM)")
    b = Browser(binary, width=1280, height=900)
    try:
        b.load((scratch.path / "report.html").as_uri())
        b.eval("document.getElementById('first-divergence').scrollIntoView({block: 'center'})")
        png = b.screenshot()
    finally:
        b.close()
    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64)  # flat UI colours: small, still crisp
    img.save(ROOT / "docs" / "html-report.png", optimize=True)
    size = (ROOT / "docs" / "html-report.png").stat().st_size
    print(f"wrote docs/error-by-layer.png and docs/html-report.png ({size} bytes)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a block drifted")
    p.add_argument("--force", action="store_true",
                   help="rewrite every block, also those that match up to versions, digests and last digits")
    p.add_argument("--images", action="store_true", help="also redraw docs/error-by-layer.png and docs/html-report.png")
    args = p.parse_args(argv)
    names = used_examples(PAGES)
    with tempfile.TemporaryDirectory(prefix="ag-docs-") as tmp:
        scratch = Scratch(Path(tmp).resolve())
        outputs = render(names, scratch)
        drift = update(PAGES, outputs, args.check, args.force)
        if args.images and not args.check:
            images(scratch)
    if args.check and drift:
        print("\n\n".join(drift))
        print(f"\n{len(drift)} example block(s) drifted; rebuild them with: python docs/build_examples.py")
        return 1
    print(f"{len(names)} examples, {'all current' if not drift else f'{len(drift)} rebuilt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
