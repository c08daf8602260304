"""Max pooling through torch's channels-last kernel on the CPU: the built-in CNNs' ``MaxPool2d``.

Why: on the CPU, torch's max pooling of a contiguous (N, C, H, W) tensor walks each plane
window by window, while its channels-last kernel vectorises across channels. For the small CNN's
first pool (32 x 16 x 32 x 32 floats, one thread) a training step's forward and backward take
about 3.6 ms the plain way and 1.5 ms through channels-last, and a CIFAR-10 batch trains about
1.7x as fast in all (``tests/test_pooling.py`` checks the bits, ``benchmarks/engine_speed.py``
the speed).

The result is the same to the bit. A max is exact whatever the memory layout, and both kernels
take the first maximum of a window in the same scan order (rows, then columns), so they record the
same indices and the backward pass routes each gradient to the same input. The output and the
input's gradient are contiguous again, as the plain op's are, so the next convolution sees the
layout (and takes the algorithm) it saw before.

Where the channels-last kernel does not apply it is the plain op: on a GPU, for an unbatched (C,
H, W) input, when ``return_indices`` is asked for, and under functorch's transforms (the cohort
trainer maps a model over its stack with ``vmap``, whose rules know the plain op).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.utils import _pair


class _ChannelsLastPool(torch.autograd.Function):
    """Forward through the channels-last kernel; backward by the plain backward op on the saved
    indices (the same op the plain pool's backward calls)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        kernel, stride, padding, dilation, ceil_mode = args
        out, idx = torch.ops.aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel, stride, padding, dilation, ceil_mode
        )
        ctx.save_for_backward(x, idx.contiguous())
        ctx.args = args
        return out.contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, idx = ctx.saved_tensors
        g = torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, idx)
        return (g, *(None,) * len(ctx.args))


def _plain(x: torch.Tensor, return_indices: bool) -> bool:
    return (
        return_indices
        or x.dim() != 4
        or x.device.type != "cpu"
        or torch._C._are_functorch_transforms_active()
    )


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose CPU forward and backward go through the channels-last kernel (see the
    module's docstring); same parameters, same results, no state of its own. A subclass, so code
    that recognises a max pool (the stacked-chain kernel) recognises this one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _plain(x, self.return_indices):
            return super().forward(x)
        args = (
            list(_pair(self.kernel_size)),
            list(_pair(self.stride if self.stride is not None else self.kernel_size)),
            list(_pair(self.padding)),
            list(_pair(self.dilation)),
            self.ceil_mode,
        )
        if torch.is_grad_enabled() and x.requires_grad:
            return _ChannelsLastPool.apply(x, *args)
        return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), *args).contiguous()
