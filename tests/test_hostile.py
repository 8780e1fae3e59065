"""Hostile golden files: HDF5 features a golden never uses, built for real with h5py.

Each construct is first shown to *work* against plain h5py (the control: it really follows the
link, reads the other file, declares the huge size, runs the plugin), then shown to be refused
by activation_guard with a :class:`GoldenSecurityError` (or another ``GoldenError``) that names
the file and the object at fault, before any value is read or any large buffer allocated.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import zlib
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch
from golden_edit import index_dict, set_index
from models import one_thread
from torch import nn

import activation_guard as ag
from activation_guard import store

SECRET = b"TOP-SECRET-ag-hostile-test-" * 4096  # "another file on the machine"


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def wide_model() -> nn.Module:
    """Leaves above SMALL_LEAF_BYTES (4 x 4100 float32 = 65.6 KB), so each gets /data/NNNNNN."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4100)).eval()


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
XW = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def goldens(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile_base")
    with one_thread():
        ag.record(small_model(), X, path=d / "small.h5")
        ag.record(wide_model(), XW, path=d / "wide.h5", inputs=False)  # outputs only: every leaf in /data
        ag.record(wide_model(), XW, path=d / "wide_lzf.h5", compression="lzf", inputs=False)
    return {"small": d / "small.h5", "wide": d / "wide.h5", "wide_lzf": d / "wide_lzf.h5"}


def forge(src: Path, dst: Path, edit: Callable[[h5py.File], Any]) -> Path:
    """Copy a real golden and edit it in place with h5py."""
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def set_json(f: h5py.File, key: str, obj: Any) -> None:
    """Replace /index or /meta *and* its checksum, as a deliberate attacker would."""
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    del f[key]
    f.create_dataset(key, data=np.frombuffer(raw, dtype=np.uint8))
    f.attrs[f"{key}_crc32"] = np.int64(zlib.crc32(raw))


def get_json(f: h5py.File, key: str) -> Any:
    """/meta, or the index in format 2's shape (whatever the file's version: golden_edit)."""
    return index_dict(f) if key == "index" else json.loads(f[key][()].tobytes())


def first_data_entry(f: h5py.File) -> dict[str, Any]:
    for c in get_json(f, "index")["calls"]:
        for leaf in c["leaves"]:
            if "dataset" in leaf:
                return leaf
    raise AssertionError("no /data leaf")


def refused(path: Path, err: type[ag.GoldenError], *words: str) -> ag.GoldenError:
    """Opening (and a full read) must raise ``err`` naming the file, the problem and a fix."""
    with pytest.raises(err) as ei, ag.read_golden(path) as r:
        for _ in r.iter_tensors():
            pass
    e = ei.value
    msg = str(e)
    assert str(path) in msg and e.path == str(path)
    assert "to fix" in msg and e.fix
    for w in words:
        assert w in msg, (w, msg)
    assert SECRET[:20].decode() not in msg  # nothing read from another file leaks into the error
    return e


def load_all(path: Path) -> list[torch.Tensor]:
    with ag.read_golden(path) as r:
        return [t for _, _, t in r.iter_tensors()]


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize("where", ["/index", "/packs", "/packs/0000"])
def test_external_link_is_never_followed(goldens, tmp_path, where):
    other = tmp_path / "other.h5"
    shutil.copyfile(goldens["small"], other)  # a *valid* target: only the link check can stop it
    parent, _, name = where.rpartition("/")

    def edit(f: h5py.File) -> None:
        g = f[parent or "/"]
        del g[name]
        g[name] = h5py.ExternalLink(str(other), where)

    bad = forge(goldens["small"], tmp_path / "g.h5", edit)
    with h5py.File(bad, "r") as f:  # control: plain h5py follows it into the other file
        assert f[where].file.filename == str(other)
    refused(bad, ag.GoldenSecurityError, "ExternalLink", name)
    with pytest.raises(ag.GoldenSecurityError):
        ag.compare(small_model(), X, path=bad)


def test_soft_link_cycle_is_refused(goldens, tmp_path):
    def edit(f: h5py.File) -> None:
        f["packs"]["cycle"] = h5py.SoftLink("/packs")  # /packs/cycle/cycle/... forever

    bad = forge(goldens["small"], tmp_path / "g.h5", edit)
    with h5py.File(bad, "r") as f:  # control: the cycle resolves to any depth
        assert isinstance(f["packs/cycle/cycle/cycle/cycle/0000"], h5py.Dataset)
    refused(bad, ag.GoldenSecurityError, "/packs/cycle", "SoftLink")


def test_soft_link_in_place_of_a_dataset_is_refused(goldens, tmp_path):
    """A soft link named like a real pack, pointing at another object."""

    def edit(f: h5py.File) -> None:
        f.move("packs/0000", "moved")
        f["packs"]["0000"] = h5py.SoftLink("/moved")

    bad = forge(goldens["small"], tmp_path / "g.h5", edit)
    refused(bad, ag.GoldenError)


def test_soft_link_at_the_group_level_is_refused(goldens, tmp_path):
    """``get(name, getlink=True)`` only checks the last path component: the reader checks every
    level, so ``/packs`` itself being a soft link (to ``/data``) is refused too."""

    def edit(f: h5py.File) -> None:
        assert "packs" not in f  # this golden's leaves are all large: only /data
        f["packs"] = h5py.SoftLink("/data")

    bad = forge(goldens["wide"], tmp_path / "g.h5", edit)
    with h5py.File(bad, "r") as f:  # control: the path resolves through the soft link
        assert isinstance(f["packs/000000"], h5py.Dataset)
    refused(bad, ag.GoldenSecurityError, "/packs", "SoftLink")


# --------------------------------------------------------------------------- other files' bytes


def test_external_raw_storage_with_absolute_path_is_refused(goldens, tmp_path):
    secret = tmp_path / "secret.bin"
    with h5py.File(goldens["wide"], "r") as f:
        leaf = first_data_entry(f)
    nbytes = leaf["nbytes"]
    secret.write_bytes((SECRET * (nbytes // len(SECRET) + 1))[:nbytes])

    def edit(f: h5py.File) -> None:
        name = leaf["dataset"]
        del f[name]
        f.create_dataset(name, shape=tuple(leaf["shape"]), dtype="<f4", external=[(str(secret.resolve()), 0, nbytes)])
        idx = get_json(f, "index")
        for c in idx["calls"]:
            for lf in c["leaves"]:
                if lf.get("dataset") == name:
                    lf["crc32"] = zlib.crc32(secret.read_bytes())  # the checksum matches the secret
        set_index(f, idx)

    bad = forge(goldens["wide"], tmp_path / "g.h5", edit)
    with h5py.File(bad, "r") as f:  # control: plain h5py returns the other file's contents
        assert f[leaf["dataset"]][()].tobytes() == secret.read_bytes()
    refused(bad, ag.GoldenSecurityError, "external raw storage", leaf["dataset"])
    with pytest.raises(ag.GoldenSecurityError):
        ag.compare(wide_model(), XW, path=bad)


def test_virtual_dataset_is_refused(goldens, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(goldens["wide"], "r") as f:
        leaf = first_data_entry(f)
        values = f[leaf["dataset"]][()]
    with h5py.File(other, "w") as f:
        f["v"] = values  # identical values: only the layout check can refuse it

    def edit(f: h5py.File) -> None:
        name = leaf["dataset"]
        layout = h5py.VirtualLayout(shape=values.shape, dtype=values.dtype)
        layout[...] = h5py.VirtualSource(str(other), "v", shape=values.shape)
        del f[name]
        f.create_virtual_dataset(name, layout)

    bad = forge(goldens["wide"], tmp_path / "g.h5", edit)
    with h5py.File(bad, "r") as f:  # control: plain h5py reads the other file through it
        assert f[leaf["dataset"]].is_virtual
        assert np.array_equal(f[leaf["dataset"]][()], values)
    refused(bad, ag.GoldenSecurityError, "virtual dataset", leaf["dataset"])


# --------------------------------------------------------------------------- allocation bombs


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_4_tib_dataset_in_a_tiny_file_is_refused_without_allocating(goldens, tmp_path):
    n = 2**40 // 4  # 4 TiB of float32

    def edit(f: h5py.File) -> None:
        idx = get_json(f, "index")
        leaf = idx["calls"][0]["leaves"][0]
        name = leaf.pop("dataset")
        leaf.update(shape=[n], nbytes=n * 4, dataset=name)
        del f[name]
        d = f.create_dataset(name, shape=(n,), dtype="<f4", chunks=(1 << 16,), compression="gzip")
        d[:16] = 1.0  # one real chunk; the rest "exists" as fill value
        set_index(f, idx)

    bad = forge(goldens["wide"], tmp_path / "g.h5", edit)
    size = bad.stat().st_size
    with h5py.File(bad, "r") as f:  # control: plain h5py would be asked for 4 TiB
        ds = f["data/000000"]
        assert ds.size * ds.dtype.itemsize == 2**40
    assert size < 1_000_000
    before = _rss_kb()
    refused(bad, ag.GoldenSecurityError, "refusing to allocate")
    assert _rss_kb() - before < 200_000  # KB: nothing near the declared size was allocated


def test_declared_contiguous_storage_without_bytes_is_refused(goldens, tmp_path):
    n = 2**40 // 4

    def edit(f: h5py.File) -> None:
        idx = get_json(f, "index")
        leaf = idx["calls"][0]["leaves"][0]
        leaf.update(shape=[n], nbytes=n * 4)
        del f[leaf["dataset"]]
        f.create_dataset(leaf["dataset"], shape=(n,), dtype="<f4")  # never written: 0 bytes stored
        set_index(f, idx)

    bad = forge(goldens["wide"], tmp_path / "g.h5", edit)
    refused(bad, ag.GoldenCorruptError, "declares")


def test_huge_declared_pack_and_index_are_refused(goldens, tmp_path):
    def edit_pack(f: h5py.File) -> None:
        del f["packs/0000"]
        d = f.create_dataset("packs/0000", shape=(2**40,), dtype="u1", chunks=(1 << 16,), compression="gzip")
        d[:8] = 1

    refused(forge(goldens["small"], tmp_path / "p.h5", edit_pack), ag.GoldenFormatError, "/packs/0000")

    def edit_index(f: h5py.File) -> None:
        del f["index"]
        d = f.create_dataset("index", shape=(2**40,), dtype="u1", chunks=(1 << 16,), compression="gzip")
        d[:8] = 1

    refused(forge(goldens["small"], tmp_path / "i.h5", edit_index), ag.GoldenCorruptError, "/index")


def test_a_compressed_pack_is_refused_at_open(goldens, tmp_path):
    """Packs are written contiguous. A gzip pack of 32 MiB of zeros is ~32 KB on disk, and each
    leaf read from it decompressed it whole: a 580 KB golden cost minutes of CPU (textconv, run
    by `git diff`, included). Refused at open, before any leaf is read; a golden recorded with
    compression (only /data/* compressed) still opens."""
    def edit(f: h5py.File) -> None:
        n = f["packs/0000"].shape[0]
        data = f["packs/0000"][()]
        del f["packs/0000"]
        f.create_dataset("packs/0000", data=data, shape=(n,), chunks=(max(n, 1),), compression="gzip")

    forged = forge(goldens["small"], tmp_path / "gz.h5", edit)
    with pytest.raises(ag.GoldenFormatError, match=r"/packs/0000 is chunked or compressed"):
        ag.read_golden(forged)
    assert ag.compare(small_model(), X, path=goldens["small"]).ok
    assert len(load_all(goldens["wide_lzf"])) > 0


def test_array_attribute_in_place_of_a_scalar_is_refused_unread(goldens, tmp_path):
    def edit(f: h5py.File) -> None:
        f.attrs["ag_format_version"] = np.ones(8000, dtype=np.int64)

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenFormatError, "ag_format_version", "wrong type")


def test_attribute_declaring_8_tib_is_refused(goldens, tmp_path):
    """An attribute whose dataspace was patched to 2**40 elements in a small file."""
    marker = 123456789

    def edit(f: h5py.File) -> None:
        f.attrs["meta_crc32"] = np.full(1000, marker, dtype=np.int64)

    bad = forge(goldens["small"], tmp_path / "g.h5", edit)
    data = bytearray(bad.read_bytes())
    dims = (1000).to_bytes(8, "little")
    at = [i for i in range(len(data) - 16) if data[i : i + 8] == dims and data[i + 8 : i + 16] == dims]
    assert at, "dataspace dims of the attribute not found"
    data[at[0] : at[0] + 16] = (2**40).to_bytes(8, "little") * 2  # dim and maxdim
    bad.write_bytes(bytes(data))
    before = _rss_kb()
    refused(bad, ag.GoldenError)
    assert _rss_kb() - before < 200_000


def test_deeply_nested_groups_are_refused(goldens, tmp_path):
    def edit(f: h5py.File) -> None:
        g = f["packs"].create_group("deep")
        for _ in range(300):
            g = g.create_group("d")

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenFormatError, "/packs/deep",
            "should be a dataset")

    def edit_top(f: h5py.File) -> None:
        g = f.create_group("extra")
        for _ in range(300):
            g = g.create_group("d")

    refused(forge(goldens["small"], tmp_path / "t.h5", edit_top), ag.GoldenFormatError, "unexpected object /extra")


def test_deeply_nested_json_index_is_refused(goldens, tmp_path):
    def edit(f: h5py.File) -> None:
        raw = b'{"calls":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        del f["index"]
        f.create_dataset("index", data=np.frombuffer(raw, dtype=np.uint8))
        f.attrs["index_crc32"] = np.int64(zlib.crc32(raw))

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenError, "index")


@pytest.mark.parametrize("kind", ["group", "named datatype"])
def test_other_object_kinds_where_a_dataset_belongs(goldens, tmp_path, kind):
    def edit(f: h5py.File) -> None:
        del f["packs/0000"]
        if kind == "group":
            f["packs"].create_group("0000")
        else:
            f["packs/0000"] = np.dtype("<f4")

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenFormatError, "/packs/0000",
            "should be a dataset")


# --------------------------------------------------------------------------- filters


def test_builtin_filter_outside_the_allow_list_is_refused(goldens, tmp_path):
    """scale-offset (id 6) is built into libhdf5, lossy, and never used by goldens."""
    with h5py.File(goldens["wide"], "r") as f:
        leaf = first_data_entry(f)
        values = f[leaf["dataset"]][()]

    def edit(f: h5py.File) -> None:
        del f[leaf["dataset"]]
        f.create_dataset(leaf["dataset"], data=values, scaleoffset=2)

    refused(forge(goldens["wide"], tmp_path / "g.h5", edit), ag.GoldenSecurityError, "filter id 6")


UNKNOWN_FILTER = 54321


def patch_filter_id(src: Path, dst: Path, new_id: int) -> int:
    """Turn every lzf (32000) entry of the filter pipelines into ``new_id`` by patching bytes.

    h5py cannot create a dataset with a filter that is not registered, so the pipeline message
    of an lzf golden is edited: version-1 pipeline entries are ``id:u16, name_len:u16,
    flags:u16, n_values:u16, name``, and h5py names lzf "lzf".
    """
    data = bytearray(src.read_bytes())
    n, i = 0, data.find(b"lzf\x00")
    while i != -1:
        if int.from_bytes(data[i - 8 : i - 6], "little") == 32000:
            data[i - 8 : i - 6] = new_id.to_bytes(2, "little")
            n += 1
        i = data.find(b"lzf\x00", i + 1)
    dst.write_bytes(bytes(data))
    return n


def test_unknown_filter_id_is_refused(goldens, tmp_path):
    bad = tmp_path / "g.h5"
    assert patch_filter_id(goldens["wide_lzf"], bad, UNKNOWN_FILTER) >= 1
    with h5py.File(bad, "r") as f:  # control: the pipeline really names the unknown filter
        dcpl = f["data/000000"].id.get_create_plist()
        assert UNKNOWN_FILTER in {dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())}
    refused(bad, ag.GoldenSecurityError, f"filter id {UNKNOWN_FILTER}", "plugin")


PLUGIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void ag_marker(void) {
  const char *p = getenv("AG_PLUGIN_MARKER");
  if (p) { FILE *f = fopen(p, "w"); if (f) { fputs("plugin code ran\n", f); fclose(f); } }
}
int H5PLget_plugin_type(void) { return 0; }
const void *H5PLget_plugin_info(void) { return NULL; }
"""

@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a fake HDF5 plugin")
def test_filter_plugin_code_never_runs(goldens, tmp_path, monkeypatch):
    """A fake filter plugin on the HDF5 plugin path writes a marker when libhdf5 dlopens it.

    activation_guard refuses the patched golden before libhdf5 ever looks for a plugin (no
    marker); then, as the control, plain h5py reading the same dataset runs the plugin's code.
    """
    if os.environ.get("HDF5_PLUGIN_PRELOAD") == "::":
        pytest.skip("plugin loading is disabled in this environment (HDF5_PLUGIN_PRELOAD=::)")
    plugdir = tmp_path / "plugins"
    plugdir.mkdir()
    (tmp_path / "fake.c").write_text(PLUGIN_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plugdir / "libagfake.so"), str(tmp_path / "fake.c")],
                   check=True)
    bad = tmp_path / "g.h5"
    assert patch_filter_id(goldens["wide_lzf"], bad, UNKNOWN_FILTER) >= 1
    marker = tmp_path / "marker"
    monkeypatch.setenv("AG_PLUGIN_MARKER", str(marker))
    h5py.h5pl.prepend(str(plugdir).encode())
    try:
        refused(bad, ag.GoldenSecurityError, f"filter id {UNKNOWN_FILTER}")
        with pytest.raises(ag.GoldenSecurityError):
            ag.compare(wide_model(), XW, path=bad)
        assert not marker.exists(), "activation_guard let libhdf5 load a filter plugin"
        with h5py.File(bad, "r") as f, pytest.raises(OSError, match="plugin"):
            f["data/000000"][()]
        assert marker.exists(), "control failed: plain h5py did not load the plugin"
    finally:
        for i in range(h5py.h5pl.size()):
            if h5py.h5pl.get(i) == str(plugdir).encode():
                h5py.h5pl.remove(i)
                break


# --------------------------------------------------------------------------- sanity


@pytest.mark.parametrize("key", ["meta", "index"])
def test_a_json_record_with_a_null_dataspace_is_the_wrong_type(goldens, tmp_path, key):
    """h5py.Empty: no shape at all (the low-level id's shape is None), refused as the wrong type."""
    def edit(f: h5py.File) -> None:
        del f[key]
        f.create_dataset(key, data=h5py.Empty("u1"))

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenFormatError, f"/{key} has the wrong type")


@pytest.mark.parametrize("link", ["hard", "soft", "external"])
def test_a_member_name_that_is_not_utf8_is_refused_unfollowed(goldens, tmp_path, link):
    def edit(f: h5py.File) -> None:
        g = f["packs"].id
        if link == "hard":
            g.links.create_hard(b"\xff\xfe", f.id, b"packs/0000")
        elif link == "soft":
            g.links.create_soft(b"\xff\xfe", b"/packs/0000")
        else:
            g.links.create_external(b"\xff\xfe", str(tmp_path / "secret.h5").encode(), b"/x")

    refused(forge(goldens["small"], tmp_path / "g.h5", edit), ag.GoldenFormatError, "/packs", "not UTF-8")


def test_a_damaged_root_header_is_corruption_not_a_foreign_file(goldens, tmp_path):
    """The root group's first header message (its symbol table) set to NIL: the root is no longer
    a group. Read through the file id, its attributes would just seem absent and the file "not an
    activation_guard golden"; opened as the root group it is reported damaged."""
    bad = tmp_path / "g.h5"
    shutil.copyfile(goldens["small"], bad)
    raw = bytearray(bad.read_bytes())
    header = int.from_bytes(raw[64:72], "little")  # superblock v0: the root entry's object header address
    assert raw[header] == 1, "the writer's files have a version-1 root object header"
    raw[header + 16] = 0  # first message's type
    bad.write_bytes(bytes(raw))
    refused(bad, ag.GoldenCorruptError, "damaged")


def test_the_unmodified_bases_still_load(goldens):
    """The forging helpers do not damage anything by themselves (guards the tests above)."""
    for p in goldens.values():
        assert load_all(p)
    for name, model, x in (("small", small_model(), X), ("wide", wide_model(), XW)):
        assert ag.compare(model, x, path=goldens[name]).ok


def test_allowed_filters_are_the_documented_ones():
    assert {1, 2, 3, 32000} == store.ALLOWED_FILTERS
