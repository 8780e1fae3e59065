"""The package surface: lazy public names, and a plugin import that does not pull in torch."""

from __future__ import annotations

import subprocess
import sys

import activation_guard as ag


def test_every_public_name_resolves_and_is_listed():
    assert set(ag.__all__) - {"__version__"} == set(ag._LAZY)
    for name in ag.__all__:
        assert getattr(ag, name) is not None


def test_no_submodule_shadows_a_public_name_or_the_standard_library():
    """Importing a submodule binds it on the package: a module named like a public function
    (``compare``) would replace that function. None may share a public name or a stdlib name."""
    import importlib
    import pkgutil

    names = [m.name for m in pkgutil.iter_modules(ag.__path__) if m.name != "__main__"]
    for name in names:
        importlib.import_module(f"activation_guard.{name}")
    assert not set(names) & set(ag.__all__)
    assert not set(names) & set(sys.stdlib_module_names)
    assert callable(ag.compare) and ag.compare.__module__ == "activation_guard.api.run"


def test_loading_the_plugin_does_not_import_torch_or_h5py():
    """Every pytest run in an environment with the package loads the plugin; one that never uses
    it must not pay for importing torch and h5py."""
    code = "import sys, activation_guard.plugin; print('torch' in sys.modules, 'h5py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
