"""TF32 emulation on the CPU: what a GPU with ``allow_tf32`` would compute, without a GPU.

Tensor cores round float32 matmul and convolution operands to TF32 (10 explicit mantissa bits).
Checking a CPU golden against such a run is the everyday cross-device case; emulating it lets
the calibrated tolerances and their tests be exercised on machines without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _round_bits(t: torch.Tensor) -> torch.Tensor:
    bits = t.detach().contiguous().view(torch.int32)
    lsb = torch.bitwise_and(torch.bitwise_right_shift(bits, 13), 1)
    rounded = torch.bitwise_and(bits + 0x0FFF + lsb, -0x2000).view(torch.float32)
    return torch.where(torch.isfinite(t.detach()), rounded, t.detach()).view(t.shape)


class _StraightThrough(torch.autograd.Function):
    """The rounded values forward, the gradient passed through unchanged (gradients):
    a TF32 matmul's backward is a matmul of the same operands, so an emulated run's gradients
    keep flowing into its weights instead of stopping at the rounding."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return _round_bits(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def tf32_round(t: Any) -> Any:
    """Round a float32 tensor to TF32 precision (10 explicit mantissa bits, round to nearest
    even), as TF32 tensor cores do with matmul inputs. Anything else is returned unchanged, so a
    float64 shadow forward is untouched. Differentiable (straight through) when ``t`` requires grad."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(t)
    return _round_bits(t)


def _operand_table() -> dict[Any, tuple[int, ...]]:
    F = torch.nn.functional
    two = (0, 1)
    table: dict[Any, tuple[int, ...]] = {
        F.linear: two, F.bilinear: two,
        F.conv1d: two, F.conv2d: two, F.conv3d: two,
        F.conv_transpose1d: two, F.conv_transpose2d: two, F.conv_transpose3d: two,
        torch.matmul: two, torch.mm: two, torch.bmm: two,
        torch.Tensor.matmul: two, torch.Tensor.mm: two, torch.Tensor.bmm: two,
        torch.Tensor.__matmul__: two, torch.Tensor.__rmatmul__: two,
        torch.addmm: (1, 2), torch.baddbmm: (1, 2), torch.addbmm: (1, 2),
        torch.Tensor.addmm: (1, 2), torch.Tensor.baddbmm: (1, 2), torch.Tensor.addbmm: (1, 2),
        torch.Tensor.addmm_: (1, 2), torch.Tensor.baddbmm_: (1, 2), torch.Tensor.addbmm_: (1, 2),
        torch.linalg.matmul: two, torch.tensordot: two, torch.inner: two, torch.Tensor.inner: two,
        F.scaled_dot_product_attention: (0, 1, 2),
    }
    return table


class emulate_tf32(TorchFunctionMode):
    """Within this block, float32 matmul/convolution/attention operands are rounded to TF32
    first: a CPU simulation of a GPU run with ``allow_tf32`` on. float64 math is unaffected.

    >>> with activation_guard.emulate_tf32():
    ...     report = activation_guard.compare(model, x, path=golden, tolerance="calibrated")
    """

    _ops: dict[Any, tuple[int, ...]] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if emulate_tf32._ops is None:
            emulate_tf32._ops = _operand_table()
        idx = emulate_tf32._ops.get(func)
        if idx is not None:
            args = tuple(tf32_round(a) if i in idx else a for i, a in enumerate(args))
            names = ("weight", "other", "mat1", "mat2", "batch1", "batch2", "query", "key", "value")
            for k in (("input", *names) if 0 in idx else names):
                if k in kwargs:
                    kwargs[k] = tf32_round(kwargs[k])
        elif func is torch.einsum and args and isinstance(args[0], str):
            if len(args) == 2 and isinstance(args[1], (list, tuple)):
                args = (args[0], [tf32_round(a) for a in args[1]])
            else:
                args = (args[0], *(tf32_round(a) for a in args[1:]))
        elif func is torch.linalg.multi_dot and args and isinstance(args[0], (list, tuple)):
            args = ([tf32_round(a) for a in args[0]], *args[1:])
        elif func is torch.chain_matmul:
            args = tuple(tf32_round(a) for a in args)
        return func(*args, **kwargs)
