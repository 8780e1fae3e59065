"""Seeded hashing for fingerprints: one keyed hash, the same bits on the host and on any device.

The hash of a flat index is SplitMix64's finalizer applied to ``key + index * golden_gamma``
(mod 2**64). The host version uses Python integers; the device version uses int64 tensor ops,
whose add and multiply wrap modulo 2**64 on CPU and CUDA alike, and masks every right shift
afterwards because int64 ``>>`` is arithmetic. Each use of the user's seed (each sketch row, the
in-block signs, the sample positions, the non-finite position hashes) gets its own key, so the
hash functions are independent. docs/fingerprint.md models them as uniformly random functions.
"""

from __future__ import annotations

import functools

import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

V_BIT = 32  # bit of the block hash giving the block sign v[k]
W_BIT = 48  # bit of the hash giving the diagonal sign w[c]
HASH31 = (1 << 31) - 1

# key domains: each use of the seed gets its own independent hash function
_DOMAIN_ROW = 0x5B7E
_DOMAIN_U = 0x0A11
_DOMAIN_SAMPLE = 0x5A3B
_DOMAIN_NONFINITE = 0x7F00


# --------------------------------------------------------------------------- host hashing


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a 64-bit unsigned integer (host reference, exact)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def prf(key: int, index: int) -> int:
    """The keyed hash of a flat index: ``mix64(key + index * golden_gamma)`` (mod 2**64)."""
    return mix64((key + index * GOLDEN_GAMMA) & MASK64)


def derive_key(seed: int, domain: int, number: int = 0) -> int:
    """An independent 64-bit key for one use (``domain``, ``number``) of a seed."""
    return mix64(mix64(seed ^ (domain << 32)) + number * GOLDEN_GAMMA)


def row_keys(seed: int, rows: int) -> list[int]:
    return [derive_key(seed, _DOMAIN_ROW, r) for r in range(rows)]


def u_keys(seed: int, rows: int) -> list[int]:
    return [derive_key(seed, _DOMAIN_U, r) for r in range(rows)]


def nonfinite_keys(seed: int) -> list[int]:
    """Keys of the two 31-bit hashes summed over each class of non-finite positions."""
    return [derive_key(seed, _DOMAIN_NONFINITE, h) for h in range(2)]


def signed64(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# --------------------------------------------------------------------------- device hashing


def _lshr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` is arithmetic: mask the sign copies)."""
    return torch.bitwise_and(torch.bitwise_right_shift(z, s), (1 << (64 - s)) - 1)


def prf_tensor(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """:func:`prf` on int64 tensors (``keys`` and ``index`` broadcast): the same bits as the host
    reference on any device, since int64 add/mul wrap modulo 2**64."""
    z = index * signed64(GOLDEN_GAMMA) + keys
    z = torch.bitwise_xor(z, _lshr(z, 30)) * signed64(MIX1)
    z = torch.bitwise_xor(z, _lshr(z, 27)) * signed64(MIX2)
    return torch.bitwise_xor(z, _lshr(z, 31))


def bit_at(h: torch.Tensor, b: int) -> torch.Tensor:
    return torch.bitwise_and(torch.bitwise_right_shift(h, b), 1)  # bit b survives an arithmetic shift


def sign_of_bit(bit: torch.Tensor) -> torch.Tensor:
    return (1 - 2 * bit).to(torch.float64)


# --------------------------------------------------------------------------- sample positions


@functools.lru_cache(maxsize=4096)
def sample_positions(seed: int, numel: int, samples: int) -> tuple[int, ...]:
    """Flat indices of the sampled elements: a pure function of (seed, numel, samples).

    Stratified: the flat range is cut into ``samples`` equal strata and one position is drawn
    in each, so the samples cover the whole tensor (a change confined to the last rows is as
    likely to be hit as one in the first). With fewer elements than samples, every element.
    """
    if numel <= samples:
        return tuple(range(numel))
    key = derive_key(seed, _DOMAIN_SAMPLE)
    out = []
    for s in range(samples):
        lo = s * numel // samples
        hi = (s + 1) * numel // samples
        out.append(lo + prf(key, s) % (hi - lo))
    return tuple(out)
