"""softmax with PyTorch, the way a researcher writes it.

The forward is `torch.softmax`, which computes in float32 for 16-bit inputs (on the GPU ATen's
softmax kernels, on the CPU its vectorised loops) and rounds once to the input's dtype. The
backward is the formula of README.md in float32 torch ops. Both sum in the library's own,
undocumented order, so README.md bounds them by what holds for every order.

`SoftmaxFunction` is the autograd.Function over the two, `softmax(x)` the function a model
calls and `Softmax(dim)` the drop-in for torch.nn.Softmax; torch's own autograd would do the
same, and this file is the baseline the kernels are checked and timed against.
"""

import torch

from reference import SoftmaxModule, as_rows, check_backward, check_forward


def softmax_forward(x, y):
    check_forward(x, y)
    if x.numel():
        y.copy_(torch.softmax(x, dim=-1))
    return y


def softmax_backward(y, dy, dx):
    check_backward(y, dy, dx)
    if y.numel():
        y32, dy32 = as_rows(y)[0].float(), as_rows(dy)[0].float()
        dot = (dy32 * y32).sum(dim=-1, keepdim=True)
        dx.copy_((y32 * (dy32 - dot)).view(dx.shape))
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x, torch.empty_like(x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, torch.empty_like(y))


def softmax(x):
    """softmax over x's last dimension, differentiable."""
    return SoftmaxFunction.apply(x)


class Softmax(SoftmaxModule):
    """Drop-in for torch.nn.Softmax(dim), on this file's softmax."""

    last_dim_softmax = staticmethod(softmax)
