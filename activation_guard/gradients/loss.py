"""The loss a gradient golden differentiates, and how a golden records it (meta ``backward``).

``backward=True``: the sum over the model output's floating leaves of ``leaf * c`` with ``c`` a fixed,
seeded random cotangent per leaf (a uniform ``.sum()`` would hide errors that cancel); the seed is
stored, so compare draws the same cotangents. ``backward=<fn>``: the user's scalar loss, which a
golden cannot store (compare needs the function again).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._core.errors import ActivationGuardError
from ..values.leaves import flatten

META_KEY = "backward"  # the golden meta's record of the loss (and gradient noise floors)
META_VERSION = 1
DEFAULT_SEED = 0
COTANGENT_RULE = ("backward from the model output's floating and complex tensor leaves with gradient c each (for a "
                  "real leaf the loss (leaf * c).sum()), c = torch.randn(leaf.shape, dtype=torch.float32 "
                  "(torch.complex64 for a complex leaf), generator=torch.Generator('cpu')"
                  ".manual_seed(path_seed(seed, leaf path))), one generator per leaf seeded by its path, then "
                  "cast to the leaf's dtype and device; path_seed: the first 8 bytes of blake2b('<seed>:<path>') "
                  "as a little-endian integer, its top bit cleared")
# goldens before per-path cotangents drew them from one generator in flatten order (meta without "cotangents")
COTANGENT_RULE_ORDERED = ("loss = sum over the model output's floating tensor leaves, in flatten order, of "
                          "(leaf * c).sum(), with c = torch.randn(leaf.shape, dtype=torch.float32, "
                          "generator=torch.Generator('cpu').manual_seed(seed)) drawn from one generator in that "
                          "order, then cast to the leaf's dtype and device")
BY_PATH = "by-path"  # meta "cotangents": each leaf's cotangent seeded by its path


def path_seed(seed: int, path: str) -> int:
    """The seed of one output leaf's cotangent: the same leaf (by path) gets the same cotangent
    whatever the order of the output's entries (a dict returned in another key order)."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class LossRule:
    """What the backward differentiates: ``cotangent`` (a fixed seeded random cotangent on every
    floating output leaf; a uniform ``.sum()`` would hide errors that cancel) or ``custom`` (the
    user's ``fn(output) -> scalar``, which a golden cannot store: compare needs it again)."""

    kind: str
    seed: int = DEFAULT_SEED
    fn: Callable[[Any], Any] | None = field(default=None, compare=False)
    name: str = ""
    by_path: bool = True  # False: a golden's cotangents drawn in flatten order, from one generator

    def to_meta(self) -> dict[str, Any]:
        if self.kind == "cotangent":
            if not self.by_path:
                return {"version": META_VERSION, "loss": "cotangent", "seed": self.seed, "rule": COTANGENT_RULE_ORDERED}
            return {"version": META_VERSION, "loss": "cotangent", "seed": self.seed, "cotangents": BY_PATH,
                    "rule": COTANGENT_RULE}
        return {"version": META_VERSION, "loss": "custom", "function": self.name}

    def describe(self) -> str:
        if self.kind == "cotangent":
            return f"sum of each floating output times a seeded random cotangent (seed {self.seed})"
        return f"the custom loss {self.name}"

    def roots(self, output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors to differentiate and their gradients (``None``: a scalar loss)."""
        if self.kind == "custom":
            assert self.fn is not None
            loss = self.fn(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = (type(loss).__name__ if not isinstance(loss, torch.Tensor)
                       else f"a tensor of shape {list(loss.shape)}")
                raise ActivationGuardError(f"option backward: the loss function {self.name} returned {got}; it must "
                                           f"return a scalar tensor computed from the model's output")
            if not loss.requires_grad:
                raise ActivationGuardError(
                    f"option backward: the loss {self.name} returned does not require grad (it does not depend on "
                    f"any parameter: frozen model, or a detached output?)")
            return [loss.reshape(())], None
        gen = torch.Generator("cpu").manual_seed(self.seed)
        roots, grads = [], []
        opaque = []  # containers walked by type only (a deque, a cache object): their tensors are not seen
        for leaf in flatten(output):
            if leaf.kind == "object":
                opaque.append(leaf.type_name)
            t = leaf.tensor
            if leaf.kind != "tensor" or t is None or leaf.type_name != "Tensor":
                continue
            # complex leaves get a complex cotangent (per-path rule only: older goldens skipped them)
            cplx = self.by_path and t.is_complex()
            if not t.is_floating_point() and not cplx:
                continue
            if self.by_path:
                gen = torch.Generator("cpu").manual_seed(path_seed(self.seed, leaf.path))
            # drawn for every floating leaf, on the CPU whatever torch.set_default_device says (the
            # generator is a CPU one, and the golden's cotangents are the CPU's numbers)
            c = torch.randn(tuple(t.shape), dtype=torch.complex64 if cplx else torch.float32,
                            generator=gen, device="cpu")
            if t.requires_grad:
                roots.append(t)
                grads.append(c.to(device=t.device, dtype=t.dtype))
        if not roots:
            hidden = (f"; its output holds {', '.join(sorted(set(opaque)))}, which activation_guard compares by "
                      f"type only and does not look into: return the tensors in a tuple, list, dict or dataclass, "
                      f"or pass backward=<a loss function of the output>" if opaque else "")
            raise ActivationGuardError(
                "option backward=True: no floating or complex tensor in the model's output requires grad, so there "
                "is no gradient to record (all parameters frozen, the output detached, or the call made under "
                f"torch.inference_mode()?){hidden}")
        return roots, grads


def loss_rule(backward: Any, seed: int = DEFAULT_SEED) -> LossRule | None:
    """The rule an option value asks for: ``False`` none, ``True`` the seeded cotangent, a
    callable the custom loss."""
    if backward is False or backward is None:
        return None
    if backward is True:
        return LossRule("cotangent", seed)
    name = f"{getattr(backward, '__module__', '?')}.{getattr(backward, '__qualname__', type(backward).__name__)}"
    return LossRule("custom", fn=backward, name=name)
