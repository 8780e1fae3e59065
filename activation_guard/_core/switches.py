"""On/off switches read from environment variables: one vocabulary and one error for all of them.

``ACTIVATION_GUARD_FINGERPRINT_WORKER`` and ``ACTIVATION_GUARD_NATIVE`` used to parse their values
apart, with different words, and an unknown value was an error for one and meant "on" for the
other.
"""

from __future__ import annotations

import os

from .errors import OptionError

_VALUES = {"": None, "auto": None, "on": True, "1": True, "true": True, "yes": True,
           "off": False, "0": False, "false": False, "no": False}


def read(name: str) -> bool | None:
    """True (on), False (off) or None (unset or ``auto``: the caller decides). Any other value is an
    :class:`~activation_guard._core.errors.OptionError` naming the variable."""
    raw = os.environ.get(name, "")
    key = raw.strip().lower()
    if key not in _VALUES:
        raise OptionError(name, raw, "environment variable", "expected auto, on (1, true, yes) or off (0, false, no)")
    return _VALUES[key]
