"""SwiGLU with PyTorch, the way a researcher writes it, and the model plumbing every
implementation of this folder shares.

The forward widens to float32, `g * torch.sigmoid(g) * u`, and rounds once to the dtype; the
backward is README.md's formula in float32 torch ops, sigmoid recomputed from g. torch's
sigmoid is `1 / (1 + exp(-g))` with an accurate exp (CUDA's expf, 2 ulp; the CPU's, 1 ulp) of
the exact argument, which README.md's bound takes as EXP_ARGUMENT_ROUNDINGS = 0.

`model_plumbing(name, forward, backward)` turns a pair of plain functions (this file's, or the
Triton one) into what a model uses: torch.library custom ops with fake implementations
(torch.compile(fullgraph=True) sees opaque calls with known outputs), their autograd, an
autograd.Function, `swiglu(g, u=None)` and the module `SwiGLU`; each takes g and u, or the
fused gate-up tensor alone.
"""

import functools
from types import SimpleNamespace

import torch

from reference import check_backward, check_forward, halves

# Roundings of exp's argument before the exp itself (README.md, "The error bound"): none, torch
# evaluates exp(-g) at the exact -g.
EXP_ARGUMENT_ROUNDINGS = 0


def swiglu_forward(g, u, y):
    check_forward(g, u, y)
    gate, up = halves(g) if u is None else (g, u)
    if y.numel():
        g32 = gate.float()
        y.copy_(g32 * torch.sigmoid(g32) * up.float())
    return y


def swiglu_backward(g, u, dy, dg, du=None):
    check_backward(g, u, dy, dg, du)
    gate, up = halves(g) if u is None else (g, u)
    d_gate, d_up = halves(dg) if u is None else (dg, du)
    if dy.numel():
        g32, u32, dy32 = gate.float(), up.float(), dy.float()
        s = torch.sigmoid(g32)
        # Both gradients before either store: dg and du may be g, u or dy themselves.
        grad_gate = dy32 * u32 * s * (1 + g32 * (1 - s))
        grad_up = dy32 * (g32 * s)
        d_gate.copy_(grad_gate)
        d_up.copy_(grad_up)
    return dg, du


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


# --- Model plumbing, shared by torch_impl and triton_impl ------------------------------------


def fresh_output(g, u):
    """A fresh y for a forward call: g's shape, or half of it for the fused tensor."""
    if u is not None:
        return torch.empty_like(g)
    return g.new_empty((*g.shape[:-1], g.shape[-1] // 2))


def model_plumbing(name, forward, backward):
    """Custom ops kernel_course::swiglu_<name>_{forward,backward} over the plain functions,
    their fakes and autograd; returns a namespace with SwiGLUFunction (the eager path),
    swiglu (differentiable, traceable) and the SwiGLU module."""

    @torch.library.custom_op(f"kernel_course::swiglu_{name}_forward", mutates_args=())
    def forward_op(g: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        return forward(g, u, fresh_output(g, u))

    @torch.library.custom_op(f"kernel_course::swiglu_{name}_backward", mutates_args=())
    def backward_op(
        g: torch.Tensor, u: torch.Tensor | None, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if u is None:  # an op returns a fixed number of tensors: an empty du
            return backward(g, None, dy, torch.empty_like(g))[0], g.new_empty(0)
        return backward(g, u, dy, torch.empty_like(g), torch.empty_like(u))

    @forward_op.register_fake
    def _(g, u):
        return fresh_output(g, u)

    @backward_op.register_fake
    def _(g, u, dy):
        return torch.empty_like(g), g.new_empty(0) if u is None else torch.empty_like(u)

    def setup_context(ctx, inputs, output):
        g, u = inputs
        ctx.fused = u is None
        ctx.save_for_backward(g, *(() if ctx.fused else (u,)))

    def backward_of_forward_op(ctx, dy):
        g, *u = ctx.saved_tensors
        dg, du = backward_op(g, u[0] if u else None, dy)
        return dg, None if ctx.fused else du

    forward_op.register_autograd(backward_of_forward_op, setup_context=setup_context)

    class SwiGLUFunction(torch.autograd.Function):
        """SwiGLU over the plain functions: apply(g, u) or apply(gu, None) -> y (the eager
        path, no custom op)."""

        @staticmethod
        def forward(ctx, g, u=None):
            y = forward(g, u, fresh_output(g, u))
            ctx.fused = u is None
            ctx.save_for_backward(g, *(() if ctx.fused else (u,)))
            return y

        @staticmethod
        @once_differentiable  # a second derivative raises instead of coming out wrong
        def backward(ctx, dy):
            g, *u = ctx.saved_tensors
            if ctx.fused:
                return backward(g, None, dy, torch.empty_like(g))[0], None
            return backward(g, u[0], dy, torch.empty_like(g), torch.empty_like(u[0]))

    def swiglu(g, u=None):
        """silu(g) * u, or of the two halves of the fused gate-up tensor g when u is None:
        differentiable and traceable. Eager calls take the autograd.Function: a custom op's
        Python dispatch costs tens of microseconds a call; torch.compile sees the op."""
        if not torch.compiler.is_compiling():
            return SwiGLUFunction.apply(g, u)
        return forward_op(g, u)

    class SwiGLU(torch.nn.Module):
        """The activation of Llama's MLP, without parameters: forward(g, u) = silu(g) * u, or
        forward(gu) on the fused gate-up projection's output (g its first half, u its second),
        so that `down(SwiGLU()(gate_up(x)))` is the MLP."""

        def forward(self, g, u=None):
            return swiglu(g, u)

    # pickle (torch.save of a whole model) finds a class by module and name: the calling file,
    # whose forward this is, binds it as `SwiGLU`
    SwiGLU.__module__, SwiGLU.__qualname__ = forward.__module__, "SwiGLU"
    return SimpleNamespace(
        SwiGLUFunction=SwiGLUFunction,
        swiglu=swiglu,
        SwiGLU=SwiGLU,
        forward_op=forward_op,
        backward_op=backward_op,
    )


_plumbing = model_plumbing("torch", swiglu_forward, swiglu_backward)
SwiGLUFunction, swiglu, SwiGLU = _plumbing.SwiGLUFunction, _plumbing.swiglu, _plumbing.SwiGLU
