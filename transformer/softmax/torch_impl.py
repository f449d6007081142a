"""softmax with PyTorch, the way a researcher writes it.

The forward is `torch.softmax`, which computes in float32 for 16-bit inputs (on the GPU ATen's
softmax kernels, on the CPU its vectorised loops) and rounds once to the input's dtype. The
backward is the formula of README.md in float32 torch ops. Both sum in the library's own,
undocumented order, so README.md bounds them by what holds for every order.

`SoftmaxFunction` is the autograd.Function over the two, `softmax(x)` the function a model
calls (the custom op under torch.compile, as for the kernels) and `Softmax(dim)` the drop-in for
torch.nn.Softmax; torch's own autograd would do the same, and this file is the baseline the
kernels are checked and timed against.
`autograd_function` and `traceable_softmax` build the autograd.Function and the custom ops over
any pair of plain functions: triton_impl.py and cute_impl.py call them with theirs.
"""

import functools

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


class SecondDerivativeRaises(torch.autograd.Function):
    """The identity on a gradient, whose own backward raises (see once_differentiable)."""

    @staticmethod
    def forward(ctx, gradient):
        return gradient.clone()

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(
            "the course's backward is not differentiable: no double backward (a gradient of "
            "a gradient taken with create_graph=True)"
        )


def once_differentiable(backward):
    """backward(ctx, *gradients) run without recording a graph. Under create_graph=True every
    gradient it returns goes through SecondDerivativeRaises: differentiating it raises instead
    of seeing a constant. torch's once_differentiable does so only when an incoming gradient
    requires grad, so a loss linear in the output (or a gradient computed from saved tensors
    alone) gave a wrong second derivative silently."""

    @functools.wraps(backward)
    def wrapper(ctx, *gradients):
        if not torch.is_grad_enabled():  # create_graph=False: no graph, nothing to wrap
            return backward(ctx, *gradients)
        with torch.no_grad():
            result = backward(ctx, *gradients)

        def raising(g):  # a leaf that requires grad, so that the node is recorded
            return g if g is None else SecondDerivativeRaises.apply(g.detach().requires_grad_())

        return tuple(map(raising, result)) if isinstance(result, tuple) else raising(result)

    return wrapper


def autograd_function(forward, backward):
    """SoftmaxFunction over a pair of plain functions (this file's, Triton's or CuTe's): the
    eager path, saving y for the backward."""

    class SoftmaxFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = forward(x, torch.empty_like(x))
            ctx.save_for_backward(y)
            return y

        @staticmethod
        @once_differentiable  # a second derivative raises instead of coming out wrong
        def backward(ctx, dy):
            (y,) = ctx.saved_tensors
            return backward(y, dy, torch.empty_like(y))

    return SoftmaxFunction


def traceable_softmax(name, forward, backward, eager):
    """softmax(x) over a pair of plain functions registered as the custom ops
    kernel_course::softmax_<name>_{forward,backward}: torch.compile sees an opaque call with a
    known output (register_fake) instead of tracing into the launcher, and a backward it can put
    in its graph. `eager` is autograd_function's Function over the same pair."""

    @torch.library.custom_op(f"kernel_course::softmax_{name}_forward", mutates_args=())
    def forward_op(x: torch.Tensor) -> torch.Tensor:
        return forward(x, torch.empty_like(x))

    @torch.library.custom_op(f"kernel_course::softmax_{name}_backward", mutates_args=())
    def backward_op(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return backward(y, dy, torch.empty_like(y))

    @forward_op.register_fake
    def _(x):
        return torch.empty_like(x)

    @backward_op.register_fake
    def _(y, dy):
        return torch.empty_like(y)

    def save_output(ctx, inputs, output):
        ctx.save_for_backward(output)

    def backward_of_forward_op(ctx, dy):
        (y,) = ctx.saved_tensors
        return backward_op(y, dy)

    forward_op.register_autograd(backward_of_forward_op, setup_context=save_output)

    def softmax(x):
        """softmax over x's last dimension: differentiable, and traceable by torch.compile.
        Eager calls take the autograd.Function: a custom op's Python dispatch costs tens of
        microseconds a call, more than a small kernel's whole run; torch.compile sees the op."""
        if torch.compiler.is_compiling():
            return forward_op(x)
        return eager.apply(x)

    return softmax


SoftmaxFunction = autograd_function(softmax_forward, softmax_backward)
# A custom op under torch.compile here too: traced through, the operand checks' address
# arithmetic fails on symbolic shapes (dynamic=True, or a shape that changes between steps).
softmax = traceable_softmax("torch", softmax_forward, softmax_backward, SoftmaxFunction)


class Softmax(SoftmaxModule):
    """Drop-in for torch.nn.Softmax(dim), on this file's softmax."""

    last_dim_softmax = staticmethod(softmax)
