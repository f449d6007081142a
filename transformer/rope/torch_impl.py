"""RoPE with PyTorch, the way a researcher writes it, and the model plumbing every
implementation of this folder shares.

The angles as Hugging Face's Llama computes them: theta = float32(p) * inv_freq in float32,
then cos and sin (or the table's rows, gathered); q and k widened to float32, rotated pair by
pair, rounded once to their dtype. README.md bounds the float32 angle's error at large p.

`model_plumbing(name, forward, backward)` turns a pair of plain functions (this file's, or the
Triton ones) into what a model uses: torch.library custom ops with fake implementations
(torch.compile(fullgraph=True) sees opaque calls with known outputs), their autograd, an
autograd.Function, `rope(q, k, ...)` and `RotaryEmbedding`, a module holding inv_freq like
Hugging Face's LlamaRotaryEmbedding that applies the rotation itself.
"""

import functools
from types import SimpleNamespace

import torch

from reference import (
    canonical,
    check_rope,
    inverse_frequencies,
    join_halves,
    pair_halves,
    table_half,
)


def positions_of(position_ids, batch, seq, device):
    if position_ids is None:
        return torch.arange(seq, device=device).expand(batch, seq)
    return position_ids.expand(batch, seq)


def angles_float32(q, cos, sin, inv_freq, position_ids, interleaved, direction):
    """(cos, sin) of every token's angles, float32 of shape (B, S, 1, D/2); rows of the table
    outside it are NaN."""
    batch, seq, _, head_dim = q.shape
    positions = positions_of(position_ids, batch, seq, q.device)
    if cos is None:
        theta = positions.float()[..., None] * inv_freq  # rounded to float32: README's bound
        c, s = theta.cos(), theta.sin()
    else:
        inside = ((positions >= 0) & (positions < cos.shape[0]))[..., None]
        index = positions.clamp(0, cos.shape[0] - 1)
        c, s = (table_half(t, head_dim // 2, interleaved)[index].float().where(inside, torch.nan)
                for t in (cos, sin))  # fmt: skip
    return c[:, :, None], direction * s[:, :, None]


def rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                direction):  # fmt: skip
    check_rope(q, k, q_out, k_out, cos=cos, sin=sin, inv_freq=inv_freq,
               position_ids=position_ids, layout=layout)  # fmt: skip
    q4 = canonical(q, layout)
    c, s = angles_float32(q4, cos, sin, inv_freq, position_ids, interleaved, direction)
    for x, out in ((q, q_out), (k, k_out)):
        if x.numel():
            x_a, x_b = pair_halves(canonical(x, layout).float(), interleaved)
            rotated = join_halves(x_a * c - x_b * s, x_b * c + x_a * s, interleaved)
            canonical(out, layout).copy_(rotated)  # after the whole product: in place is safe
    return q_out, k_out


def rope_forward(q, k, q_out, k_out, *, cos=None, sin=None, inv_freq=None, position_ids=None,
                 interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                       1.0)  # fmt: skip


def rope_backward(dq, dk, dq_out, dk_out, *, cos=None, sin=None, inv_freq=None,
                  position_ids=None, interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(dq, dk, dq_out, dk_out, cos, sin, inv_freq, position_ids, interleaved,
                       layout, -1.0)  # fmt: skip


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


# --- Model plumbing, shared by torch_impl and triton_impl -------------------------------------


def model_plumbing(name, forward, backward):
    """Custom ops kernel_course::rope_<name>_{forward,backward} over the plain functions, their
    fakes and autograd; returns a namespace with RoPEFunction (the eager path), rope
    (differentiable, traceable) and the RotaryEmbedding module. The angles (cos, sin,
    inv_freq) get no gradient."""

    def call(function, q, k, cos, sin, inv_freq, position_ids, interleaved, layout):
        return function(q, k, torch.empty_like(q), torch.empty_like(k), cos=cos, sin=sin,
                        inv_freq=inv_freq, position_ids=position_ids, interleaved=interleaved,
                        layout=layout)  # fmt: skip

    def register(direction, function):
        @torch.library.custom_op(f"kernel_course::rope_{name}_{direction}", mutates_args=())
        def op(
            q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
            inv_freq: torch.Tensor | None, position_ids: torch.Tensor | None, interleaved: bool,
            layout: str,
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            return call(function, q, k, cos, sin, inv_freq, position_ids, interleaved, layout)

        @op.register_fake
        def _(q, k, cos, sin, inv_freq, position_ids, interleaved, layout):
            return torch.empty_like(q), torch.empty_like(k)

        return op

    forward_op, backward_op = register("forward", forward), register("backward", backward)

    def setup_context(ctx, inputs, output):
        ctx.angles, ctx.options = inputs[2:6], inputs[6:]

    def backward_of_forward_op(ctx, dq, dk):
        dq, dk = backward_op(dq, dk, *ctx.angles, *ctx.options)
        return dq, dk, None, None, None, None, None, None

    forward_op.register_autograd(backward_of_forward_op, setup_context=setup_context)

    class RoPEFunction(torch.autograd.Function):
        """RoPE over the plain functions: apply(q, k, cos, sin, inv_freq, position_ids,
        interleaved, layout) -> (q rotated, k rotated) (the eager path, no custom op)."""

        @staticmethod
        def forward(ctx, q, k, cos, sin, inv_freq, position_ids, interleaved, layout):
            ctx.angles, ctx.options = (cos, sin, inv_freq, position_ids), (interleaved, layout)
            return call(forward, q, k, cos, sin, inv_freq, position_ids, interleaved, layout)

        @staticmethod
        @once_differentiable  # a second derivative raises instead of coming out wrong
        def backward(ctx, dq, dk):
            dq, dk = call(backward, dq, dk, *ctx.angles, *ctx.options)
            return dq, dk, None, None, None, None, None, None

    def rope(q, k, *, cos=None, sin=None, inv_freq=None, position_ids=None, interleaved=False,
             layout="bshd"):  # fmt: skip
        """(q, k) rotated by their tokens' angles: differentiable and traceable. Eager calls
        take the autograd.Function: a custom op's Python dispatch costs tens of microseconds a
        call, more than a small kernel's whole run; torch.compile sees the op."""
        args = (q, k, cos, sin, inv_freq, position_ids, interleaved, layout)
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (cos, sin, inv_freq)
        ):  # their gradient would be None, silently
            raise ValueError(
                "the angles (cos, sin, inv_freq) get no gradient: pass them without "
                "requires_grad (learned frequencies are not supported)"
            )
        if not torch.compiler.is_compiling():
            return RoPEFunction.apply(*args)
        return forward_op(*args)

    class RotaryEmbedding(torch.nn.Module):
        """Rotary embedding of head_dim-long heads: holds inv_freq (a buffer left out of the
        state_dict, as Hugging Face's LlamaRotaryEmbedding does) and applies the rotation:
        forward(q, k, position_ids=None) -> (q, k) rotated."""

        def __init__(self, head_dim, base=10000.0, llama3_scaling=None, interleaved=False,
                     layout="bshd", device=None):  # fmt: skip
            super().__init__()
            self.head_dim, self.base, self.llama3_scaling = head_dim, base, llama3_scaling
            self.interleaved, self.layout = interleaved, layout
            inv_freq = inverse_frequencies(head_dim, base, llama3_scaling)
            self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

        def _apply(self, fn, recurse=True):
            # .half() and .to(dtype) round every floating buffer, to_empty() leaves it
            # uninitialised (a model built on the meta device): inv_freq, in no state_dict, is
            # computed again in float32 (README.md's bound assumes its exact values) on the
            # device the buffer moved to
            super()._apply(fn, recurse)
            exact = inverse_frequencies(self.head_dim, self.base, self.llama3_scaling)
            self.inv_freq = exact.to(self.inv_freq.device)
            return self

        def extra_repr(self):
            return (f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}, "
                    f"layout={self.layout!r}")  # fmt: skip

        def forward(self, q, k, position_ids=None):
            return rope(q, k, inv_freq=self.inv_freq, position_ids=position_ids,
                        interleaved=self.interleaved, layout=self.layout)  # fmt: skip

    # pickle (torch.save of a whole model) finds a class by module and name: the calling file,
    # whose forward this is, binds it as `RotaryEmbedding`
    RotaryEmbedding.__module__, RotaryEmbedding.__qualname__ = forward.__module__, "RotaryEmbedding"
    return SimpleNamespace(
        RoPEFunction=RoPEFunction,
        rope=rope,
        RotaryEmbedding=RotaryEmbedding,
        forward_op=forward_op,
        backward_op=backward_op,
    )


_plumbing = model_plumbing("torch", rope_forward, rope_backward)
RoPEFunction, RotaryEmbedding = _plumbing.RoPEFunction, _plumbing.RotaryEmbedding
rope = _plumbing.rope
