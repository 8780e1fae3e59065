"""The golden store: documented layout readable with plain h5py, byte-reproducible re-recording,
atomic writes that never damage the previous golden, and defensive reading."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from golden_edit import to_v2
from models import build_cnn, cnn_input, one_thread, tiny_mlp
from torch import nn

import activation_guard as ag
from activation_guard import store
from activation_guard.store import writer


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():  # see models.one_thread: 1000x faster tiny forwards on a loaded machine
        yield


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


class PackedAndLarge(nn.Module):
    """Small leaves (packed) and one leaf above SMALL_LEAF_BYTES (its own dataset), plus odd
    outputs (None, str, object), so every storage path is exercised."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.small = nn.Linear(8, 8)
        self.big = nn.Linear(8, 600)  # 40 x 600 float32 = 96 KB > 64 KB
        self.low = nn.Linear(600, 4).to(torch.bfloat16)

    def forward(self, x):
        h = self.big(self.small(x))
        return {"out": self.low(h.bfloat16()), "none": None, "name": "v1", "big": h}


XB = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))


def listing(d) -> list[str]:
    return sorted(os.listdir(d))


# --------------------------------------------------------------------------- layout


def format_doc_example() -> str:
    """The plain-h5py reader of docs/format.md ("Reading a golden with plain h5py"), as printed there."""
    text = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    section = text[text.index("## Reading a golden with plain h5py"):]
    return section[section.index("```python") + len("```python"):section.index("```\n\n")]


def plain_index(f: h5py.File) -> dict:
    """The index read back with json and numpy only, by the docs' own example (not through
    activation_guard's decoder)."""
    code = format_doc_example()
    ns: dict = {}
    exec(code[:code.index("with h5py.File(")], ns)
    return {"calls": ns["index_calls"](f)}


def test_the_format_docs_reader_reads_both_versions(tmp_path, capsys):
    """The docs' example, run as printed, on a format-3 golden and a committed format-2 one."""
    code = format_doc_example()
    committed = "golden/tests/examples/test_cnn/test_small_cnn[1].h5"
    assert committed in code
    new, old = tmp_path / "g.h5", tmp_path / "v2.h5"
    ag.record(PackedAndLarge(), XB, path=new)
    ag.record(PackedAndLarge(), XB, path=old)
    with h5py.File(old, "r+") as f:
        to_v2(f)
    versions = []
    for path in (str(new), str(old), str(Path(__file__).parents[1] / committed)):
        with h5py.File(path, "r") as f:
            versions.append(int(f.attrs["ag_format_version"]))
        with ag.read_golden(path) as r:
            want = [f"{c.name} {c.call} {leaf.path} {leaf.dtype} {list(leaf.shape)}"
                    for c in r.calls for leaf in c.leaves if leaf.kind == "tensor"]
        exec(code.replace(committed, path), {})
        assert capsys.readouterr().out.splitlines() == want, path
    assert versions == [3, 2, 1]  # the committed goldens were written in format 1


def test_layout_is_readable_with_plain_h5py(tmp_path):
    path = tmp_path / "g.h5"
    summary = ag.record(PackedAndLarge(), XB, path=path, inputs=False)  # the output layout
    assert summary.file_bytes == os.path.getsize(path)
    assert summary.layer_calls == 4 and summary.names == ["small", "big", "low", ""]
    assert summary.leaves == 3 + 4
    assert summary.nbytes == (40 * 8 + 40 * 600) * 4 + 2 * (40 * 4 * 2) + 40 * 600 * 4
    with h5py.File(path, "r") as f:
        assert f.attrs["ag_format"] == b"activation_guard.golden"  # fixed-length ASCII
        assert not f.attrs.get_id("ag_format").get_type().is_variable_str()
        assert int(f.attrs["ag_format_version"]) == store.FORMAT_VERSION == 3
        assert set(f) == {"index", "meta", "packs", "data", "calls", "leaves", "dims"}
        index = plain_index(f)
        meta = json.loads(f["meta"][()].tobytes())
        assert [(c["name"], c["call"], c["type"]) for c in index["calls"]] == [
            ("small", 0, "Linear"), ("big", 0, "Linear"), ("low", 0, "Linear"), ("", 0, "PackedAndLarge")
        ]
        big = index["calls"][1]["leaves"][0]
        assert (big["dtype"], big["shape"], big["dataset"]) == ("float32", [40, 600], "data/000000")
        np.testing.assert_array_equal(f[big["dataset"]][()],
                                      PackedAndLarge().big(PackedAndLarge().small(XB)).detach().numpy())
        half = index["calls"][2]["leaves"][0]
        assert half["dtype"] == "bfloat16" and "pack" in half
        raw = f["packs"][f"{half['pack']:04d}"][half["offset"] : half["offset"] + half["nbytes"]]
        assert raw.size == 40 * 4 * 2
        root = {leaf["path"]: leaf for leaf in index["calls"][3]["leaves"]}
        assert (root["none"]["kind"] == "none"
                and root["name"] == {"kind": "str", "value": "v1", "py": "str", "path": "name"})
    assert meta["versions"]["activation_guard"] == ag.__version__
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["device"]["device"] == "cpu"
    assert meta["model_class"].endswith("PackedAndLarge")
    assert meta["layer_calls"] == 4
    fp, kw = meta["inputs"]
    assert kw == {"kind": "object", "path": "kwargs", "type": "empty dict"}
    assert fp["path"] == "args/0" and fp["shape"] == [40, 8] and fp["dtype"] == "float32"
    assert fp["sha256"] == hashlib.sha256(XB.numpy().tobytes()).hexdigest()


def test_no_object_dtypes_or_pickle_anywhere(tmp_path):
    path = tmp_path / "g.h5"
    ag.record(PackedAndLarge(), XB, path=path)
    kinds = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: kinds.append(obj.dtype.kind) if isinstance(obj, h5py.Dataset) else None)
    assert kinds and "O" not in kinds and "V" not in kinds
    assert b"pickle" not in path.read_bytes() and b"\x80\x04\x95" not in path.read_bytes()


# --------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_rerecording_is_byte_identical(tmp_path, compression):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    ag.record(PackedAndLarge(), XB, path=a, compression=compression)
    ag.record(PackedAndLarge(), XB, path=b, compression=compression)
    assert a.read_bytes() == b.read_bytes()
    first = a.read_bytes()
    ag.record(PackedAndLarge(), XB, path=a, compression=compression)  # overwrite in place
    assert a.read_bytes() == first
    with ag.read_golden(a) as r:
        assert len(list(r.iter_tensors())) == 5


def test_real_model_rerecording_is_byte_identical(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    ag.record(build_cnn(), cnn_input(), path=a)
    ag.record(build_cnn(), cnn_input(), path=b)
    assert a.read_bytes() == b.read_bytes()


def test_different_values_give_different_bytes(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    ag.record(tiny_mlp(), X, path=a)
    ag.record(tiny_mlp(seed=1), X, path=b)
    assert a.read_bytes() != b.read_bytes()


def test_compression_is_validated_and_readable(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        ag.record(tiny_mlp(), X, path=tmp_path / "g.h5", compression="blosc")
    path = tmp_path / "z.h5"
    ag.record(PackedAndLarge(), XB, path=path, compression="gzip")
    with h5py.File(path, "r") as f:
        assert f["data/000000"].compression == "gzip"
    assert ag.compare(PackedAndLarge(), XB, path=path).ok


# --------------------------------------------------------------------------- atomic writes


class FailsMidway(nn.Module):
    def __init__(self, exc: BaseException):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.exc = exc

    def forward(self, x):
        self.a(x)
        raise self.exc


@pytest.mark.parametrize("make", [lambda: RuntimeError("boom"), KeyboardInterrupt], ids=["error", "keyboard_interrupt"])
def test_interrupted_write_keeps_old_golden_and_leaves_no_temp(tmp_path, make):
    # the exception made here, not at collection: one kept by the parameter list would hold its
    # traceback, with the recording's frames, for the rest of the session
    exc = make()
    path = tmp_path / "g.h5"
    ag.record(PackedAndLarge(), XB, path=path)
    before = path.read_bytes()
    with pytest.raises(type(exc)):
        ag.record(FailsMidway(exc), X, path=path)
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["g.h5"]
    assert ag.compare(PackedAndLarge(), XB, path=path).ok


def test_interrupted_first_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        ag.record(FailsMidway(RuntimeError("x")), X, path=tmp_path / "sub" / "g.h5")
    assert listing(tmp_path / "sub") == []


def test_failed_replace_keeps_old_golden(tmp_path, monkeypatch):
    path = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=path)
    before = path.read_bytes()

    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "replace", no_replace)
    with pytest.raises(ag.GoldenWriteError, match="previous golden") as ei:
        ag.record(tiny_mlp(seed=3), X, path=path)
    assert ei.value.path == str(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["g.h5"]


def test_unwritable_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ag.GoldenWriteError, match="temporary file"):
        ag.record(tiny_mlp(), X, path=blocker / "g.h5")


def test_stale_temp_of_a_dead_writer_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".g.h5.abc123{store.TMP_MARK}{pid}"
    stale.write_bytes(b"half a golden")
    live = tmp_path / f".g.h5.def456{store.TMP_MARK}{os.getpid()}"  # a concurrent writer: keep
    live.write_bytes(b"in progress")
    ag.record(tiny_mlp(), X, path=tmp_path / "g.h5")
    assert listing(tmp_path) == sorted([live.name, "g.h5"])


def test_file_mode_follows_umask_and_is_kept_on_rewrite(tmp_path):
    path = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=path)
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
    path.chmod(0o640)
    ag.record(tiny_mlp(), X, path=path)
    assert path.stat().st_mode & 0o777 == 0o640


# --------------------------------------------------------------------------- defensive reading


def test_missing_golden_names_the_file(tmp_path):
    p = tmp_path / "nope.h5"
    with pytest.raises(ag.GoldenNotFoundError, match=r"nope\.h5") as ei:
        ag.compare(tiny_mlp(), X, path=p)
    assert isinstance(ei.value, FileNotFoundError) and ei.value.path == str(p)


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"", "empty"), (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n", "git lfs pull"),
     (b"garbage" * 10, "not a readable HDF5")],
    ids=["empty", "lfs", "garbage"],
)
def test_not_a_golden_files(tmp_path, content, match):
    p = tmp_path / "g.h5"
    p.write_bytes(content)
    with pytest.raises(ag.GoldenFormatError, match=match):
        ag.read_golden(p)


def test_plain_hdf5_and_newer_version_are_refused(tmp_path):
    p = tmp_path / "plain.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(ag.GoldenFormatError, match="not an activation_guard golden"):
        ag.read_golden(p)
    g = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=g)
    with h5py.File(g, "a") as f:
        f.attrs["ag_format_version"] = np.int64(99)
    with pytest.raises(ag.GoldenFormatError, match="upgrade activation_guard"):
        ag.read_golden(g)


def test_flipped_byte_is_corruption_not_divergence(tmp_path):
    path = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=path, inputs=False)  # every packed byte is an output compare reads
    with h5py.File(path, "r") as f:
        off = f["packs/0000"].id.get_offset()
    data = bytearray(path.read_bytes())
    data[off + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ag.GoldenCorruptError, match="checksum") as ei:
        ag.compare(tiny_mlp(), X, path=path)
    assert str(path) in str(ei.value)


def test_external_link_is_refused(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros(4, dtype=np.uint8)
    path = tmp_path / "g.h5"
    ag.record(tiny_mlp(), X, path=path)
    with h5py.File(path, "a") as f:
        f["packs"]["0001"] = h5py.ExternalLink(str(other), "/x")
    with pytest.raises(ag.GoldenSecurityError, match="ExternalLink"):
        ag.read_golden(path)


# --------------------------------------------------------------------------- layering


def _run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this checkout's package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(ag.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


@pytest.mark.slow
def test_store_imports_only_core_and_the_fingerprint_type():
    """Reading and writing goldens imports only ``_core`` (dtypes, errors, gcpause, slots, mapping:
    standard library only) and the fingerprint value type from the package: never capture, the
    comparator, the API or the pytest layer (or pytest itself). tests/test_layers.py checks the
    general rule on the source; this checks what an import really loads."""
    code = (
        "import sys, activation_guard\n"
        "before = set(sys.modules)\n"
        "import activation_guard.store as s\n"
        "s.GoldenReader, s.GoldenWriter\n"
        "print(s.__file__)\n"
        "print(' '.join(sorted(m for m in set(sys.modules) - before if m.startswith('activation_guard'))))\n"
        "print('pytest' in sys.modules)\n"
    )
    where, mods, has_pytest = _run_isolated(code).splitlines()
    assert where == os.path.join(os.path.dirname(os.path.abspath(ag.__file__)), "store", "__init__.py")
    added = set(mods.split())
    assert "activation_guard.capture.hooks" not in added
    assert {m for m in added if not m.startswith("activation_guard.store")} == {
        "activation_guard.fingerprints",
        "activation_guard._core.dtypes",
        "activation_guard._core.kinds",  # the leaf-kind vocabulary (typing only)
        "activation_guard._core.errors",
        "activation_guard._core.gcpause",
        "activation_guard._core.slots",
        "activation_guard.fingerprints.fingerprint",
        "activation_guard.fingerprints.params",
        "activation_guard.fingerprints.sketch",
        "activation_guard._core.native",  # the sketch's optional compiled pass (standard library and torch only)
        "activation_guard.fingerprints.plan",  # its prepared calls (sketch, native, numpy)
        "activation_guard._core.lru",  # the kernel's caches (standard library only)
        "activation_guard._core.switches",  # the compiled pass's environment switch (errors only)
        "activation_guard._core.nativebuild",  # the compiled pass's compiler and flags (standard library only)
        "activation_guard.fingerprints.hashing",
        "activation_guard._core.mapping",  # private memory mappings for the pack (standard library only)
    }
    assert {"activation_guard.store.writer", "activation_guard.store.safety"} <= added  # the import ran here
    assert has_pytest == "False"


def test_writer_takes_plain_leaves(tmp_path):
    """Any object with the LeafLike attributes is recorded exactly as a capture.Leaf is."""
    from dataclasses import dataclass

    from activation_guard.values.leaves import Leaf

    @dataclass(frozen=True)
    class Plain:
        path: str
        kind: str
        tensor: torch.Tensor | None = None
        type_name: str = ""
        value: str | None = None
        alias: dict | None = None

    t = torch.arange(20000, dtype=torch.float32)  # 80 KB: its own dataset
    fields = [("a", "tensor", t[:3], "Tensor", None), ("b", "tensor", t, "Parameter", None),
              ("c", "str", None, "str", "v1"), ("d", "none", None, "None", None), ("e", "object", None, "Gen", None)]
    digests = []
    for cls in (Leaf, Plain):
        w = store.GoldenWriter(tmp_path / f"{cls.__name__}.h5")
        w.add_call("layer", 0, "Linear", [cls(*f) for f in fields])
        w.commit({"note": "plain"})
        digests.append(hashlib.sha256((tmp_path / f"{cls.__name__}.h5").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    with store.GoldenReader(tmp_path / "Plain.h5") as r:
        (call,) = r.calls
        assert [(e.path, e.kind, e.type_name, e.value) for e in call.leaves] == [
            ("a", "tensor", "Tensor", None), ("b", "tensor", "Parameter", None), ("c", "str", "str", "v1"),
            ("d", "none", "None", None), ("e", "object", "Gen", None)]
        assert torch.equal(r.load(call.leaves[1]), t) and call.leaves[1].dataset is not None


def test_store_errors_do_not_name_pytest(tmp_path):
    """The default fix is neutral; front ends append their own command."""
    bad = tmp_path / "notes.txt"
    bad.write_text("not a golden")
    with pytest.raises(ag.GoldenFormatError) as ei:
        store.GoldenReader(bad)
    msg = str(ei.value)
    assert msg.endswith("; to fix: re-record the golden") and str(bad) in msg
    rest = msg.replace(str(bad), "")  # tmp_path itself contains "pytest"
    assert "pytest" not in rest and "--ag-" not in rest


def test_the_store_keeps_the_leaf_kinds_the_walker_makes():
    """The index encodes a leaf's kind by its position in LEAF_KINDS: the store and the walker
    use the one vocabulary (_core/kinds.py), not copies that could drift apart."""
    from activation_guard._core.kinds import LEAF_KINDS
    from activation_guard.store.format import LEAF_KINDS as STORED

    assert STORED is LEAF_KINDS
    # positions are the golden format: a new kind is appended, never inserted
    assert LEAF_KINDS == ("tensor", "none", "str", "object", "ref", "alias", "fingerprint")
