"""The package surface: lazy public names, and a plugin import that does not pull in torch."""

from __future__ import annotations

import subprocess
import sys

import activation_guard as ag


def test_every_public_name_resolves_and_is_listed():
    assert set(ag.__all__) - {"__version__"} == set(ag._LAZY)
    for name in ag.__all__:
        assert getattr(ag, name) is not None


def test_submodule_import_does_not_shadow_the_compare_function():
    import activation_guard.compare as _  # noqa: F401  (binds the submodule on the package)
    from activation_guard.compare import compare_tensors

    assert callable(ag.compare) and ag.compare.__module__ == "activation_guard.api"
    assert compare_tensors.__module__ == "activation_guard.compare"


def test_loading_the_plugin_does_not_import_torch_or_h5py():
    """Every pytest run in an environment with the package loads the plugin; one that never uses
    it must not pay for importing torch and h5py."""
    code = "import sys, activation_guard.plugin; print('torch' in sys.modules, 'h5py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
