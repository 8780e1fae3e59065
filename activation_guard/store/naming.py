"""Map a pytest node id to its golden file, readably and without collisions.

Scheme (``golden_dir`` is ``golden/`` beside the rootdir unless configured)::

    tests/examples/test_cnn.py::TestCNN::test_small[batch2]   (check name "decoder")
    -> golden/tests/examples/test_cnn/TestCNN.test_small[batch2]--decoder.h5

* the module path becomes directories; the module's ``.py`` is dropped (a module file without
  ``.py`` keeps its whole name and gets a trailing ``~``, so it cannot collide with one that has it);
* the rest of the node id (classes, test name, parameter id) becomes one file name: its parts are
  joined with ``.``, and ``--<name>`` is appended for a named check;
* the ``ag_device`` parameter is not part of the path (the plugin removes it before calling in
  here), so a CUDA run is checked against the golden recorded on CPU.

Why it is lossless: characters outside a small portable set are percent-encoded as UTF-8
(``%`` itself is ``%25``), so no component can hold ``/``, ``\\`` or ``:``, none is ``.`` or
``..``, none starts with ``.`` (hidden) or ends with ``.``/space (Windows drops those), and
Windows device names (``CON``, ``NUL``...) are escaped. Separators are kept unambiguous: ``.``
and ``[`` are escaped in class names and in the test name outside its final ``[...]``, so the
first bare ``[`` starts the parameter id and bare dots before it separate parts; a raw ``--``
only ever separates the check name (a ``--`` inside a name is written ``-%2D``; a trailing or
leading ``-`` next to the separator is escaped). Directories never end in ``.h5`` (escaped), so a
directory can never be mistaken for a golden file. A component longer than
``MAX_COMPONENT`` characters keeps a readable prefix plus ``~`` and 16 hex digits of its
SHA-256; ``~`` is always escaped otherwise, so shortened names cannot equal unshortened ones.
Every result is verified to lie inside ``golden_dir``.

Per-rank goldens (docs/distributed.md): a multi-rank run writes ``<stem>.rank<r>-of-<w>.h5``
beside ``<stem>.h5``. So that no test or check name can spell such a suffix itself, the ``.``
before a trailing ``rank<r>-of-<w>`` of a stem is escaped (``%2E``), and :func:`owner_stem`
strips a raw rank part to find the test a per-rank golden belongs to.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".h5"
NAME_SEP = "--"
MAX_COMPONENT = 120  # characters (ASCII after escaping); filesystems allow 255 bytes
_KEEP = 90  # readable prefix kept by a shortened component
SAFE = frozenset(string.ascii_letters + string.digits + "_-.,=+@()[]")
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
    | {f"COM{i}" for i in range(10)}
    | {f"LPT{i}" for i in range(10)}
    | {f"COM{c}" for c in "¹²³"}
    | {f"LPT{c}" for c in "¹²³"}
)


def _pct(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def escape(text: str, reserved: str = "") -> str:
    """Percent-encode every character outside :data:`SAFE` (and those in ``reserved``)."""
    return "".join(c if c in SAFE and c not in reserved else _pct(c) for c in text)


def _no_double_dash(text: str) -> str:
    """Make sure a raw ``--`` never occurs in already-escaped text."""
    while "--" in text:
        text = text.replace("--", "-%2D")
    return text


def _finish_component(comp: str) -> str:
    """Rules that apply to a whole path component (after escaping)."""
    if comp.startswith("."):
        comp = "%2E" + comp[1:]
    if comp.endswith("."):
        comp = comp[:-1] + "%2E"
    if comp == "":
        comp = "%"  # a lone '%' is never produced by escaping (that gives '%25')
    stem = comp.split(".", 1)[0].upper()
    if stem in _WINDOWS_RESERVED:
        comp = _pct(comp[0]) + comp[1:]
    return comp


def shorten(comp: str, original: str) -> str:
    """Cap a component's length: readable prefix + ``~`` + 16 hex of SHA-256(original)."""
    if len(comp) <= MAX_COMPONENT:
        return comp
    head = comp[:_KEEP]
    cut = head.rfind("%")
    if cut != -1 and cut > len(head) - 3:  # never cut a %XX escape in half
        head = head[:cut]
    digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{head}~{digest}"


def dir_component(name: str) -> str:
    comp = _finish_component(escape(name))
    if comp.endswith(SUFFIX):  # a directory must never look like a golden file
        comp = comp[: -len(SUFFIX)] + "%2E" + SUFFIX[1:]
    return shorten(comp, "d:" + name)


def module_component(filename: str) -> str:
    if filename.endswith(".py") and len(filename) > 3:
        return dir_component(filename[:-3])
    return shorten(dir_component(filename) + "~", "m:" + filename)


_PARAM_RE = re.compile(r"\A([^\[]*)\[(.*)\]\Z", re.DOTALL)
# the rank part of a per-rank golden's name (canonical numbers, as activation_guard.distributed writes
# them), and any text that looks like one (escaped in stems, so names never spell a rank part)
RANK_PART = re.compile(r"\.rank(0|[1-9][0-9]*)-of-([1-9][0-9]*)\Z")
_RANK_LIKE = re.compile(r"\.(rank[0-9]+-of-[0-9]+)\Z")


def split_rank_part(stem: str) -> tuple[str, int, int] | None:
    """``x.rank1-of-2`` -> ``("x", 1, 2)``: a per-rank golden's stem; None for any other stem."""
    m = RANK_PART.search(stem)
    if m is None:
        return None
    rank, world = int(m.group(1)), int(m.group(2))
    if rank >= world or world == 1:
        return None
    return stem[: m.start()], rank, world


def _no_rank_part(stem: str) -> str:
    return _RANK_LIKE.sub(r"%2E\1", stem)


def parts_stem(parts: Sequence[str]) -> str:
    """The file name (without ``--name`` and ``.h5``) for the node id parts after the module."""
    if not parts or any(not p for p in parts):
        raise ValueError(f"node id parts after the module must be non-empty names, got {list(parts)!r}")
    out = [escape(p, reserved=".[") for p in parts[:-1]]
    last = parts[-1]
    m = _PARAM_RE.match(last)
    if m:
        out.append(escape(m.group(1), reserved=".[") + "[" + escape(m.group(2)) + "]")
    else:
        out.append(escape(last, reserved=".["))
    stem = _no_double_dash(".".join(out))
    if stem.endswith("-"):
        stem = stem[:-1] + "%2D"
    return stem


def file_component(parts: Sequence[str], name: str | None = None) -> str:
    """``<stem>[--<name>].h5``; stem and name are shortened separately, so a long check name
    never hides which test a golden belongs to."""
    stem = shorten(_finish_component(parts_stem(parts)), "f:" + "\x00".join(parts))
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a check name must be a non-empty string, got {name!r}")
        n = _no_double_dash(escape(name))
        if n.startswith("-"):
            n = "%2D" + n[1:]
        if n.endswith("."):
            n = n[:-1] + "%2E"
        stem = f"{stem}{NAME_SEP}{shorten(n, 'n:' + name)}"
    return _no_rank_part(stem) + SUFFIX


@dataclass(frozen=True)
class NodeKey:
    """A node id split for path mapping: ``module`` is the rootdir-relative file path
    (``/``-separated), ``parts`` the class/function names, the last with its ``[param id]``."""

    module: str
    parts: tuple[str, ...]

    @classmethod
    def parse(cls, nodeid: str) -> NodeKey:
        if "::" not in nodeid:
            raise ValueError(f"not a test node id (no '::'): {nodeid!r}")
        module, rest = nodeid.split("::", 1)
        if not module:
            raise ValueError(f"node id {nodeid!r} has no module path")
        # split on '::' outside the final [param id] only: a param id may contain '::'
        bracket = rest.find("[")
        head, tail = (rest, "") if bracket == -1 else (rest[:bracket], rest[bracket:])
        parts = head.split("::")
        parts[-1] += tail
        return cls(module, tuple(parts))

    @property
    def nodeid(self) -> str:
        return "::".join((self.module, *self.parts))


def relative_golden_path(key: NodeKey, name: str | None = None) -> str:
    """The golden's path relative to the golden directory, always ``/``-separated."""
    comps = [c for c in key.module.split("/")]
    dirs = [dir_component(c) for c in comps[:-1]]
    dirs.append(module_component(comps[-1]))
    return "/".join([*dirs, file_component(key.parts, name)])


def golden_path(golden_dir: str | os.PathLike[str], nodeid: str | NodeKey, name: str | None = None) -> Path:
    """Absolute golden path for ``nodeid`` (device parameter already removed) under ``golden_dir``.

    Raises ``ValueError`` if the result would leave ``golden_dir`` (it cannot, by construction;
    the check guards against future changes to the scheme).
    """
    key = nodeid if isinstance(nodeid, NodeKey) else NodeKey.parse(nodeid)
    base = Path(os.path.abspath(os.fspath(golden_dir)))
    rel = relative_golden_path(key, name)
    path = Path(os.path.abspath(os.path.join(base, *rel.split("/"))))
    if os.path.commonpath([base, path]) != str(base) or path == base:
        raise ValueError(f"golden path for {key.nodeid!r} would leave the golden directory {base}")
    return path


def owner_stem(rel_path: str) -> str:
    """The test stem a golden file belongs to: ``a/b/test_x[p]--dec.h5`` -> ``a/b/test_x[p]``.

    Used to attribute golden files on disk to tests (for unused-golden detection). A raw ``--``
    only ever separates the check name, so the split is exact; shortened names have no ``--``
    and are attributed to the test whose own shortened stem they equal. A per-rank golden
    (``test_x--dec.rank1-of-2.h5``) belongs to the test of its plain golden.
    """
    if rel_path.endswith(SUFFIX):
        rel_path = rel_path[: -len(SUFFIX)]
    ranked = split_rank_part(rel_path)
    if ranked is not None:  # a per-rank golden belongs to the test of the plain one
        rel_path = ranked[0]
    d, _, f = rel_path.rpartition("/")
    f = f.split(NAME_SEP, 1)[0]
    return f"{d}/{f}" if d else f


def stem_of(key: NodeKey) -> str:
    """The owner stem (see :func:`owner_stem`) of every golden that ``key``'s checks write."""
    return owner_stem(relative_golden_path(key))


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the first bytes of every HDF5 file (every golden)


def is_hdf5_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a readable file that starts like an HDF5 file (a golden a report must
    never overwrite: the plugin's ``--ag-report`` and the CLI's report outputs)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
    except OSError:
        return False
_SHORTENED = re.compile(r"~[0-9a-f]{16}\Z")


def _unescape(comp: str) -> str | None:
    if comp == "%" or "~" in comp:  # the empty name, or a shortened component: not invertible
        return None
    return urllib.parse.unquote(comp, encoding="utf-8", errors="surrogatepass")


def module_source(module_dir: str) -> str | None:
    """The test module (rootdir-relative, ``/``-separated) whose goldens live in the golden
    directory ``module_dir`` (``tests/test_gpt2`` -> ``tests/test_gpt2.py``): the inverse of the
    directories :func:`relative_golden_path` makes. None when a shortened component hides the name."""
    comps = module_dir.split("/")
    if not module_dir or any(not c for c in comps):
        return None
    dirs = [_unescape(c) for c in comps[:-1]]
    last = comps[-1]
    if last.endswith("~") and not _SHORTENED.search(last):  # a module file without ``.py``
        name = _unescape(last[:-1])
    else:
        base = _unescape(last)
        name = None if base is None else base + ".py"
    if name is None or any(d is None for d in dirs):
        return None
    return "/".join([*(d for d in dirs if d is not None), name])
