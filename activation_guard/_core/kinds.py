"""The kinds of leaf a layer output flattens into, and a golden stores: one vocabulary for the value
walker and the store (whose index encodes a kind by its position here, so the order is format)."""

from __future__ import annotations

from typing import Literal, get_args

LeafKind = Literal["tensor", "none", "str", "object", "ref", "alias", "fingerprint"]
LEAF_KINDS: tuple[LeafKind, ...] = get_args(LeafKind)
