"""RMSNorm with PyTorch, the way a researcher writes it, and the model plumbing every
implementation of this folder shares.

The forward is Llama's: widen to float32, `torch.rsqrt(h.square().mean(-1) + eps)`, multiply,
round once to x's dtype. The backward is README.md's formula in float32 torch ops, dweight a
`sum` over the rows. torch sums in its own, undocumented order, so README.md bounds these by
what holds for every order.

`model_plumbing(name, forward, backward)` turns a pair of plain functions (this file's, or the
Triton or CuTe ones) into what a model uses: torch.library custom ops with fake
implementations (torch.compile(fullgraph=True) sees opaque calls with known outputs), their
autograd, an autograd.Function, `rmsnorm(x, weight, eps, residual=None)` and `RMSNorm`, a
drop-in for torch.nn.RMSNorm (same parameter, same state_dict key `weight`).
"""

import math
import numbers
from types import SimpleNamespace

import torch

from reference import as_rows, check_backward, check_forward


def rmsnorm_forward(x, weight, eps, y, rstd, residual=None, residual_out=None):
    check_forward(x, weight, eps, y, rstd, residual, residual_out)
    h = x
    if residual is not None:
        residual_out.copy_(x + residual)  # float32 sum rounded once to the dtype: the stream
        h = residual_out
    if h.numel():
        h32 = h.float()
        r = torch.rsqrt(h32.square().mean(dim=-1, keepdim=True) + eps)
        y.copy_(h32 * r * weight.float())
        rstd.copy_(r.squeeze(-1))
    return (y, rstd) if residual is None else (y, rstd, residual_out)


def rmsnorm_backward(x, weight, rstd, dy, dx, dweight, dresidual_out=None):
    check_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    if x.numel() == 0:
        dweight.zero_()  # a sum over no rows (or rows of no elements)
        return dx, dweight
    x32, dy32 = as_rows(x)[0].float(), as_rows(dy)[0].float()
    r = rstd.reshape(-1, 1)
    xhat, g = x32 * r, dy32 * weight.float()
    mean_dot = (g * xhat).mean(dim=-1, keepdim=True)
    grad = r * (g - xhat * mean_dot)
    if dresidual_out is not None:
        grad = grad + as_rows(dresidual_out)[0].float()
    dx.copy_(grad.view(dx.shape))
    dweight.copy_((dy32 * xhat).sum(dim=0))
    return dx, dweight


# --- Model plumbing, shared by torch_impl, triton_impl and cute_impl --------------------------


def fresh_outputs(x):
    """Fresh y and rstd for a forward call on x."""
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


def model_plumbing(name, forward, backward):
    """Custom ops kernel_course::rmsnorm_<name>_{forward,backward} over the plain functions,
    their fakes and autograd; returns a namespace with RMSNormFunction (the eager path),
    rmsnorm (differentiable, traceable) and the RMSNorm module."""

    @torch.library.custom_op(f"kernel_course::rmsnorm_{name}_forward", mutates_args=())
    def forward_op(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if residual is None:  # an op returns a fixed number of tensors: an empty h
            return (*forward(x, weight, eps, *fresh_outputs(x)), x.new_empty(0))
        return forward(x, weight, eps, *fresh_outputs(x), residual, torch.empty_like(x))

    @torch.library.custom_op(f"kernel_course::rmsnorm_{name}_backward", mutates_args=())
    def backward_op(
        h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
        dresidual_out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        dx, dweight = torch.empty_like(h), torch.empty_like(weight)
        return backward(h, weight, rstd, dy, dx, dweight, dresidual_out)

    @forward_op.register_fake
    def _(x, weight, eps, residual):
        return (*fresh_outputs(x), x.new_empty(0) if residual is None else torch.empty_like(x))

    @backward_op.register_fake
    def _(h, weight, rstd, dy, dresidual_out):
        return torch.empty_like(h), torch.empty_like(weight)

    def setup_context(ctx, inputs, output):
        x, weight, _, residual = inputs
        _, rstd, h = output
        ctx.fused = residual is not None
        ctx.save_for_backward(h if ctx.fused else x, weight, rstd)

    def backward_of_forward_op(ctx, dy, _drstd, dh):
        h, weight, rstd = ctx.saved_tensors  # rstd is a statistic: its gradient is ignored
        dx, dweight = backward_op(h, weight, rstd, dy, dh if ctx.fused else None)
        return dx, dweight, None, dx if ctx.fused else None

    forward_op.register_autograd(backward_of_forward_op, setup_context=setup_context)

    class RMSNormFunction(torch.autograd.Function):
        """RMSNorm over the plain functions: apply(x, weight, eps, residual=None) -> y, or
        (y, residual_out) with a residual (the eager path, no custom op)."""

        @staticmethod
        def forward(ctx, x, weight, eps, residual=None):
            y, rstd = fresh_outputs(x)
            h = x if residual is None else torch.empty_like(x)
            forward(x, weight, eps, y, rstd, *(() if residual is None else (residual, h)))
            ctx.fused = residual is not None
            ctx.save_for_backward(h, weight, rstd)
            return (y, h) if ctx.fused else y

        @staticmethod
        def backward(ctx, dy, dh=None):
            h, weight, rstd = ctx.saved_tensors
            dx, dweight = backward(
                h, weight, rstd, dy, torch.empty_like(h), torch.empty_like(weight), dh
            )
            return dx, dweight, None, dx if ctx.fused else None

    def rmsnorm(x, weight, eps, residual=None):
        """y = RMSNorm(x) * weight over x's last dimension, or (y, h) with h = x + residual
        normalised and returned as the new residual stream: differentiable and traceable.
        Eager calls take the autograd.Function: a custom op's Python dispatch costs tens of
        microseconds a call, more than a small kernel's whole run; torch.compile sees the op."""
        if not torch.compiler.is_compiling():
            return RMSNormFunction.apply(x, weight, eps, residual)
        y, _, h = forward_op(x, weight, eps, residual)
        return y if residual is None else (y, h)

    class RMSNorm(torch.nn.Module):
        """A drop-in for torch.nn.RMSNorm (same arguments, parameter `weight`, state_dict),
        whose forward also takes an optional residual: forward(x, residual) -> (y, h)."""

        def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                     dtype=None):  # fmt: skip
            super().__init__()
            if isinstance(normalized_shape, numbers.Integral):
                normalized_shape = (normalized_shape,)
            self.normalized_shape = tuple(normalized_shape)
            self.eps, self.elementwise_affine = eps, elementwise_affine
            n = math.prod(self.normalized_shape)
            if elementwise_affine:
                self.weight = torch.nn.Parameter(
                    torch.ones(self.normalized_shape, device=device, dtype=dtype)
                )
            else:
                self.register_parameter("weight", None)
                # the kernels always scale: a constant 1 (float32, so any x dtype), not saved
                self.register_buffer("unit_weight", torch.ones(n, device=device), persistent=False)

        def reset_parameters(self):
            if self.weight is not None:
                torch.nn.init.ones_(self.weight)

        def extra_repr(self):
            return (
                f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}"
            )

        def forward(self, x, residual=None):
            k = len(self.normalized_shape)
            if tuple(x.shape[x.dim() - k :]) != self.normalized_shape:
                raise ValueError(
                    f"x has shape {tuple(x.shape)}; its last dimensions must be "
                    f"{self.normalized_shape}"
                )
            shape = x.shape
            rows = lambda t: t.reshape(*shape[: x.dim() - k], -1)  # noqa: E731
            weight = self.unit_weight if self.weight is None else self.weight.reshape(-1)
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            out = rmsnorm(rows(x), weight, eps, None if residual is None else rows(residual))
            if residual is None:
                return out.view(shape)
            return out[0].view(shape), out[1].view(shape)

    return SimpleNamespace(
        RMSNormFunction=RMSNormFunction,
        rmsnorm=rmsnorm,
        RMSNorm=RMSNorm,
        forward_op=forward_op,
        backward_op=backward_op,
    )


_plumbing = model_plumbing("torch", rmsnorm_forward, rmsnorm_backward)
RMSNormFunction, rmsnorm, RMSNorm = _plumbing.RMSNormFunction, _plumbing.rmsnorm, _plumbing.RMSNorm
