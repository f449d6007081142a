"""RMSNorm tests, section (2), continued: autograd, custom ops, the module, torch.compile, training.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import (
    DEVICE,
    EPS,
    IMPLS,
    ON_GPU,
    U32,
    backward_bounds,
    float64_forward,
    forward_bounds,
    implementation,
    random_rows,
    random_weight,
    rows,
)

import reference
from common.tolerance import assert_same_bits, assert_within_bound, gamma

# Autograd, the custom ops, the module and torch.compile


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", ["RMSNormFunction.apply", "rmsnorm"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_autograd_matches_reference_backward(impl, entry, fused):
    """The autograd.Function and `rmsnorm` (a custom op with its own autograd) give the
    reference backward at their own rstd, within the backward bound; with a residual the
    gradients of x and of the residual are both dx."""
    fns = implementation(impl)
    call = getattr(fns, entry.split(".")[0])
    call = call.apply if entry.endswith("apply") else call
    m, n = 3, 257
    x, residual = (random_rows(m, n, torch.float32).requires_grad_() for _ in range(2))
    weight = random_weight(n, torch.float32).requires_grad_()
    dy, dh = random_rows(m, n, torch.float32), random_rows(m, n, torch.float32)
    if fused:
        y, h = call(x, weight, EPS, residual)
        torch.autograd.backward((y, h), (dy, dh))
    else:
        h, y = x.detach(), call(x, weight, EPS)
        y.backward(dy)
    _, rstd = reference.rmsnorm_forward(h.detach().cpu(), weight.detach().cpu(), EPS)
    rstd = rstd.float()
    extra = (dh.cpu(),) if fused else ()
    exact_dx, exact_dw = reference.rmsnorm_backward(
        h.detach().cpu(), weight.detach().cpu(), rstd, dy.cpu(), None, None, *extra
    )
    dx_bound, dw_bound = backward_bounds(
        impl, h.detach(), weight.detach(), rstd, dy, exact_dx, exact_dw, dh if fused else None
    )
    # The kernel's own rstd differs from the exact one by the forward's rho: widen by it.
    rho = forward_bounds(impl, h.detach(), weight.detach(), EPS, exact_dx, rstd.double())[1]
    widen = 4 * (rho / rstd.double())[:, None].cpu()
    assert_within_bound(x.grad, exact_dx, dx_bound + widen * (rows(exact_dx).abs() + 1))
    if fused:
        assert_same_bits(residual.grad, x.grad)
    assert_within_bound(weight.grad, exact_dw, dw_bound * 2 + 4 * widen.max() * exact_dw.abs())


@pytest.mark.parametrize("impl", IMPLS)
def test_module_is_a_drop_in(impl):
    """RMSNorm loads torch.nn.RMSNorm's state_dict (the key `weight`), keeps its arguments
    (normalized_shape over several dimensions, eps None = the dtype's machine epsilon,
    elementwise_affine False: no parameter, nothing saved), and computes what it computes."""
    fns = implementation(impl)
    for shape, affine in (((6, 7), True), (42, False)):
        theirs = torch.nn.RMSNorm(shape, elementwise_affine=affine, device=DEVICE)
        ours = fns.RMSNorm(shape, elementwise_affine=affine, device=DEVICE)
        if affine:
            with torch.no_grad():
                theirs.weight.copy_(random_weight(42, torch.float32).view(6, 7))
        assert ours.load_state_dict(theirs.state_dict()) is not None
        assert list(ours.state_dict()) == list(theirs.state_dict())
        assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
        x = random_rows(10, 42, torch.bfloat16).view(2, 5, 6, 7)
        if not affine:
            x = x.view(2, 5, 42)
        expected = theirs(x.float()).double()
        got = ours(x)
        assert got.shape == x.shape and got.dtype == x.dtype
        # both within their bounds of the exact answer: within the sum of each other
        assert (got.double() - expected).abs().max().item() <= 3 * 2**-8 * expected.abs().max()


class PreNormBlocks(torch.nn.Module):
    """Two Llama-style pre-norm blocks: h = x + residual, y = norm(h), residual = h."""

    def __init__(self, norm_class, n=32):
        super().__init__()
        self.norms = torch.nn.ModuleList(norm_class(n) for _ in range(2))
        self.linears = torch.nn.ModuleList(torch.nn.Linear(n, n) for _ in range(2))

    def forward(self, x):
        residual, out = x, torch.zeros_like(x)
        for norm, linear in zip(self.norms, self.linears, strict=True):
            out, residual = norm(out, residual)
            out = linear(out)
        return out + residual


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces a model that calls the custom ops, forward and
    backward with the residual fused, without graph breaks, and computes what the eager model
    computes. On the CPU the aot_eager backend (no code generation) runs the kernels."""
    fns = implementation(impl)
    torch.manual_seed(0)
    model = PreNormBlocks(fns.RMSNorm).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = torch.randn(5, 32, device=DEVICE)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled_out = compiled(x)
    compiled_out.square().sum().backward()
    # On the GPU inductor generates its own code for the linear layers around the op (fused
    # epilogues, its own reduction order for their gradients): equal within float32 rounding.
    # On the CPU aot_eager runs the eager kernels: equal bit for bit.
    same = (
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
        if ON_GPU
        else assert_same_bits
    )
    same(compiled_out.detach(), eager_out.detach())
    for p, eager_grad in zip(model.parameters(), eager_grads, strict=True):
        same(p.grad, eager_grad)


# 20 training steps of an MLP stack, the losses against torch.nn.RMSNorm's (README.md, "In
# training")

TRAIN_WIDTHS, TRAIN_BATCH, TRAIN_STEPS, TRAIN_LR = (16, 32, 32, 32, 4), 16, 20, 0.05


def mlp_stack(norm_class):
    """Linear -> norm -> ReLU, three times, then a Linear to 4 outputs (float32)."""
    layers, widths = [], TRAIN_WIDTHS
    for k_in, n in zip(widths[:-2], widths[1:-1], strict=True):
        layers += [torch.nn.Linear(k_in, n), norm_class(n, eps=EPS), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-2], widths[-1])).to(DEVICE)


def mse(out, target):
    return (out - target).square().mean()


def row_norms(t):
    return t.square().sum(-1, keepdim=True).sqrt()


def norm_error(impl, z, e_z, weight):
    """(y, e_y): the exact RMSNorm of the exact input z (float64 rows) and a bound on each
    row's ||y_hat - y||_2 when the computed input z_hat is within e_z of z (a row's 2-norm).
    y = w z / rho(z), rho = sqrt(mean z**2 + eps), has the Jacobian diag(w) (I - z z^T / (n
    rho**2)) / rho, of 2-norm <= max|w| / rho (z z^T / (n rho**2) has the eigenvalue
    1 - eps / rho**2 in [0, 1)); along the segment from z to z_hat rho >= rho - e_z / sqrt(n)
    (rho is the Euclidean norm of (z / sqrt n, sqrt eps)). The kernel's own rounding at z_hat
    is forward_bounds' with eps = 0 (where mean(h**2)'s relative error is largest, so it does
    not depend on z_hat's sum of squares) of |y| + that shift, taken over the row."""
    n, w = z.shape[-1], weight.detach().cpu().double()
    y, rstd = float64_forward(z, w, EPS)
    rho_low = 1 / rstd[:, None] - e_z / math.sqrt(n)
    assert (rho_low > 0).all(), "the input error swamps the row's scale: no bound"
    moved = w.abs().max() * e_z / rho_low
    local, _ = forward_bounds(impl, z.float(), weight.detach().cpu(), 0.0, y.abs() + moved, rstd)
    return y, moved + row_norms(local)


def loss_error(impl, model, x, target):
    """(loss, E): the exact loss of `model`'s parameters on (x, target) (float64: the stand-in
    of test_stand_ins_match_reference) and README.md's bound on the computed loss when the
    norms are `impl`'s. Errors are carried as each row's 2-norm e. A Linear's k-term dot
    products plus the bias, summed in any order (a GEMM's blocking, FMA or not), are within
    gamma_(k+1) (|W| |a_hat| + |b|) of W a_hat + b, so e' = ||W||_2 e + gamma_(k+1) (|||W| |a|
    + |b||| + |||W|||_2 e); ReLU is exact and 1-Lipschitz; the loss: (out - t) rounds once, its
    square once, the mean of B d terms gamma_(B d), with sum |r_hat**2 - r**2| <= sum over rows
    e_r (2 ||r|| + e_r) (Cauchy-Schwarz)."""
    a, e = x.cpu().double(), torch.zeros(x.shape[0], 1, dtype=torch.float64)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            w, b = layer.weight.detach().cpu().double(), layer.bias.detach().cpu().double()
            spectral, spectral_abs = (torch.linalg.matrix_norm(m, ord=2) for m in (w, w.abs()))
            rounding = gamma(w.shape[1] + 1, U32) * (
                row_norms(a.abs() @ w.abs().T + b.abs()) + spectral_abs * e
            )
            a, e = a @ w.T + b, spectral * e + rounding
        elif isinstance(layer, torch.nn.ReLU):
            a = a.clamp_min(0)
        else:
            a, e = norm_error(impl, a, e, layer.weight)
    r = a - target.cpu().double()
    r_norm = row_norms(r)
    e_r = e + U32 * (r_norm + e)
    e_square = e_r * (2 * r_norm + e_r) + U32 * (r_norm + e_r).square()
    terms = r.numel()
    loss = r.square().mean()
    return loss, (e_square.sum() + gamma(terms, U32) * (r.square().sum() + e_square.sum())) / terms


class UnbiasedRMSNorm(torch.nn.RMSNorm):
    """A negative control: mean(x**2) over N - 1 (a plausible slip), rstd 1 + 1/(2N) off."""

    def forward(self, x):
        n = x.shape[-1]
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) / (n - 1) + self.eps) * self.weight


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_like_torch(impl, compiled):
    """An MLP stack (Linear -> RMSNorm -> ReLU, three blocks) with our RMSNorm and with
    torch.nn.RMSNorm, 20 SGD steps on synthetic regression data: at every step both start
    from torch's parameters (ours loads torch's state_dict: the drop-in's keys), and the two
    losses differ by at most the sum of each side's bound (README.md, "In training"). Ours
    also steps (its backward runs, under torch.compile too) and is re-anchored. Negative
    controls: at every step, the loss of a batch that missed one example; at the first, a
    norm taking mean(x**2) over N - 1 (3-4 bounds off there; later steps move its first-order
    effect on the loss through 0, so it is no per-step control)."""
    fns = implementation(impl)
    torch.manual_seed(0)
    theirs, ours = mlp_stack(torch.nn.RMSNorm), mlp_stack(fns.RMSNorm)
    wrong = mlp_stack(UnbiasedRMSNorm)
    with torch.no_grad():  # drawn on the CPU: the same numbers, so the same bounds, on a GPU
        for layer in theirs:
            if isinstance(layer, torch.nn.RMSNorm):
                layer.weight.copy_(1 + 0.5 * torch.randn(layer.weight.shape))
    x = torch.randn(TRAIN_BATCH, TRAIN_WIDTHS[0])
    target = torch.sin(x @ torch.randn(TRAIN_WIDTHS[0], TRAIN_WIDTHS[-1])).to(DEVICE)
    x = x.to(DEVICE)
    backend = "inductor" if ON_GPU else "aot_eager"
    run = torch.compile(ours, fullgraph=True, backend=backend) if compiled else ours
    sgd_theirs = torch.optim.SGD(theirs.parameters(), lr=TRAIN_LR)
    sgd_ours = torch.optim.SGD(ours.parameters(), lr=TRAIN_LR)
    losses, worst, control = [], 0.0, math.inf
    for _ in range(TRAIN_STEPS):
        ours.load_state_dict(theirs.state_dict())
        wrong.load_state_dict(theirs.state_dict())
        loss_ours = mse(run(x), target)
        loss_theirs = mse(theirs(x), target)
        with torch.no_grad():
            loss_wrong = mse(wrong(x), target)
        exact, bound_ours = loss_error(impl, theirs, x, target)
        _, bound_theirs = loss_error("torch", theirs, x, target)
        bound = (bound_ours + bound_theirs).reshape(1)
        assert_within_bound(loss_ours.reshape(1), loss_theirs.detach().reshape(1), bound,
                            f"{impl} loss at step {len(losses)}")  # fmt: skip
        missed_one = mse(theirs(x)[1:], target[1:]).detach()
        for wrong_loss in [missed_one] + ([loss_wrong] if not losses else []):
            with pytest.raises(AssertionError, match="outside the bound"):
                assert_within_bound(wrong_loss.reshape(1), loss_theirs.detach().reshape(1), bound)
        worst = max(worst, (loss_ours - loss_theirs).abs().item() / bound.item())
        control = min(control, (missed_one - loss_theirs).abs().item() / bound.item())
        losses.append(loss_theirs.item())
        for loss, sgd in ((loss_ours, sgd_ours), (loss_theirs, sgd_theirs)):
            sgd.zero_grad()
            loss.backward()
            sgd.step()
        assert all(p.isfinite().all() for p in ours.parameters())
    print(f"{impl} {'compiled' if compiled else 'eager'}: losses {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, largest |loss - torch's| / bound {worst:.3g}, control's smallest "
          f"{control:.3g}")  # fmt: skip
    assert losses[-1] < losses[0]
