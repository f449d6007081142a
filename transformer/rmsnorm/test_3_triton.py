"""RMSNorm tests, section (3): Triton's looped and columns kernels, groups, dispatch and builds.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test import (
    DEVICE,
    DTYPES,
    EPS,
    HERE,
    ON_GPU,
    backward_bounds,
    forward_bounds,
    forward_outputs,
    forward_then_backward,
    random_rows,
    random_weight,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import reference
import triton_impl
from common.tolerance import assert_within_bound

# (3) Triton: the looped and columns kernels, the groups, and the dispatch ------------------


@pytest.fixture
def small_triton_limits(monkeypatch):
    """Register limits of 32, chunks of 16 lanes and at most 4 groups: short rows take the
    looped forward and the dots-then-columns backward, the paths the H200 takes past
    ROW_BLOCK_MAX and BACKWARD_ROW_BLOCK_MAX, at sizes the interpreter runs."""
    for name, value in (("ROW_BLOCK_MAX", 32), ("BACKWARD_ROW_BLOCK_MAX", 32), ("CHUNK", 16),
                        ("GROUPS_MAX", 4)):  # fmt: skip
        monkeypatch.setattr(triton_impl, name, value)
    triton_impl.rows_launch.cache_clear()
    triton_impl.groups_of.cache_clear()
    yield
    triton_impl.rows_launch.cache_clear()
    triton_impl.groups_of.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", [(3, 33), (9, 100), (2, 257)], ids=str)
def test_triton_looped_kernels(dtype, m, n, small_triton_limits):
    """Several chunks per row, rows split into groups of several rows, fused and not."""
    x, residual, dy, dh = (random_rows(m, n, dtype) for _ in range(4))
    weight = random_weight(n, dtype)
    forward_then_backward("triton", x, weight, dy)
    forward_then_backward("triton", x, weight, dy, residual, dh)
    assert triton_impl.forward_path(n, dtype) == -(-n // 16) - 1 + 4 + 1


def test_triton_dispatch():
    """Rows up to the register limits go to the rows kernels, several short rows a program;
    the backward's groups: at most GROUPS_MAX (the columns path: GROUPS_MAX per CHUNK)."""
    assert triton_impl.rows_launch(1000, 1, 32768) == (1024, 1, 4)
    assert triton_impl.rows_launch(3, 100, 32768)[0] == 4  # never more rows than m needs
    assert triton_impl.rows_launch(8, 32768, 32768) == (1, 32768, 32)
    assert triton_impl.rows_launch(8, 32769, 32768) is None
    assert triton_impl.groups_of(32768, 4096) == (64, 512)
    assert triton_impl.groups_of(5, 4096) == (1, 5)
    assert triton_impl.groups_of(100, 65536) == (4, 25)  # 16 chunks: 32 groups at most


def test_triton_long_rows_at_real_size():
    """N = 40000 > BACKWARD_ROW_BLOCK_MAX and > ROW_BLOCK_MAX at the real constants."""
    x, dy = random_rows(2, 40000, torch.bfloat16), random_rows(2, 40000, torch.bfloat16)
    forward_then_backward("triton", x, random_weight(40000, torch.bfloat16), dy)


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    a float32 weight, the fused residual, an int eps (passed as float32 like any float), rows
    past the register limits (the looped forward, the dots and columns backward). The
    stand-ins compute nothing."""

    def both(x, weight=None, eps=EPS, fused=False):
        weight = random_weight(x.shape[-1], x.dtype) if weight is None else weight
        y, rstd = forward_outputs(x)
        dy, dx, dweight = torch.randn_like(x), torch.empty_like(x), torch.empty_like(weight)
        extra = (torch.randn_like(x), torch.empty_like(x)) if fused else ()
        return lambda: (
            triton_impl.rmsnorm_forward(x, weight, eps, y, rstd, *extra),
            triton_impl.rmsnorm_backward(x, weight, rstd, dy, dx, dweight, *extra[:1]),
        )

    for dtype in DTYPES:
        yield both(random_rows(4, 96, dtype))
    yield both(random_rows(4, 1000, torch.float32))
    yield both(random_rows(1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96])
    yield both(torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96))
    yield both(random_rows(4, 96, torch.bfloat16), random_weight(96, torch.float32))
    yield both(random_rows(4, 96, torch.bfloat16), fused=True)
    yield both(random_rows(4, 96, torch.float32), eps=1)
    yield both(random_rows(2, 40000, torch.bfloat16))


# Each case: a forward, then the backward's rows kernel and partials sum (long rows: the dots,
# columns and sum kernels). Some cases change nothing for some kernels (the backwards after the
# strided and the misaligned x see contiguous, aligned operands; the int eps is the float32
# case again): 26 keys in all.
MIN_SPECIALISATIONS = 26

# --- The launch: Triton's host work done once per specialisation (triton_impl.launch) ---


class CompiledStandIn:
    """Stands in for the CompiledKernel Triton returns for one specialisation: run() records the
    arguments a cached launch hands the GPU."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, kernel, specialised, launches):
        self.kernel, self.specialised, self.launches = kernel, specialised, launches

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, *hooks_and_args):
        self.launches.append((self, hooks_and_args[3:]))


class KernelStandIn(JITFunction):
    """A JITFunction whose kernel[grid](...) binds the arguments as Triton's sm_90 binder does
    and records them instead of compiling; it returns a CompiledStandIn."""

    def __init__(self, fn, launches):
        super().__init__(fn)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(self.signature, self.params, backend)
        self.launches = launches

    def __getitem__(self, grid):
        def run(*args, **constants):
            bound, specialised, options = self.binder(*args, **constants)
            self.launches.append((self, tuple(bound.values()), str(specialised) + str(options)))
            return CompiledStandIn(self, str(specialised), self.launches)

        return run


def as_launched(values):
    """Launch arguments as comparable values: a tensor by its dtype, layout and address modulo
    16 (not the address: a scratch buffer is a fresh allocation at each call)."""
    return [
        (v.dtype, v.shape, v.stride(), v.data_ptr() % 16) if torch.is_tensor(v) else v
        for v in values
    ]


def test_triton_launch_once_through_triton_per_specialisation(monkeypatch):
    """Every kernel a stand-in, each case called twice: the second call takes the cached path
    (no kernel[grid]) and hands the launcher exactly the arguments Triton bound in the first;
    no specialisation goes through Triton twice, and every cached launch goes to a kernel
    compiled for the specialisation of its own arguments: a new dtype, alignment, stride class,
    size of 1 or constexpr is never served a stale kernel."""
    launches = []
    for name in dir(triton_impl):
        if name.endswith("_kernel"):
            kernel = getattr(triton_impl, name)
            monkeypatch.setattr(triton_impl, name, KernelStandIn(kernel.fn, launches))
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda _: 7)
    monkeypatch.setattr(triton_impl, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(triton_impl, "COMPILED", {})
    for call in launch_cases():
        start = len(launches)
        call()
        middle = len(launches)
        call()
        first, second = launches[start:middle], launches[middle:]
        assert all(isinstance(launch[0], CompiledStandIn) for launch in second), "went to Triton"
        assert [as_launched(f[1]) for f in first] == [as_launched(s[1]) for s in second]
    through_triton = [(id(launch[0]), launch[2]) for launch in launches if len(launch) == 3]
    assert len(set(through_triton)) == len(through_triton), "Triton compiled a key twice"
    assert len(through_triton) >= MIN_SPECIALISATIONS
    for compiled, args in (launch for launch in launches if len(launch) == 2):
        assert str(compiled.kernel.binder(*args)[1]) == compiled.specialised


# Builds every kernel for sm_90 as a launch at M = N = 1 specialises it: Triton compiles an int
# argument equal to 1 in as the constant 1 (a constexpr), so n, m, the strides and the group
# counts all arrive as constants, which the interpreter never shows. A child process: under
# TRITON_INTERPRET=1 the kernels cannot be compiled.
TRITON_ONES_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

def build(kernel, **constexprs):
    kinds = {p.name: "constexpr" if p.is_constexpr or not (p.name.endswith("_ptr") or
             p.name == "eps") else "fp32" if p.name == "eps" else "*fp32" for p in kernel.params}
    ones = {(i,): constexprs.get(name, 1) for i, name in enumerate(kinds)
            if kinds[name] == "constexpr"}
    triton.compile(ASTSource(kernel, kinds, ones), target=GPUTarget("cuda", 90, 32))

chunk = dict(CHUNK=t.CHUNK, LOG2_CHUNK=t.log2(t.CHUNK))
for fused in (False, True):
    build(t.rmsnorm_forward_rows_kernel, ROWS=1, BLOCK_N=1, LOG2_BLOCK_N=0, FUSED=fused)
    for prefetch in (False, True):
        build(t.rmsnorm_backward_rows_kernel, ROWS=1, BLOCK_N=1, LOG2_BLOCK_N=0, FUSED=fused,
              PREFETCH=prefetch)
    build(t.rmsnorm_forward_looped_kernel, **chunk, FUSED=fused)
    build(t.rmsnorm_backward_columns_kernel, CHUNK=t.CHUNK, FUSED=fused)
build(t.rmsnorm_row_dots_kernel, **chunk)
build(t.sum_partials_kernel, GROUPS_POW2=1, LOG2_GROUPS=0, BLOCK_N=t.SUM_BLOCK_N)
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch these builds at N = 1")
def test_triton_builds_with_every_int_one():
    """Each kernel compiles for sm_90 with every int argument the constant 1 (N = 1 once
    failed there: n.to() of a constexpr)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_ONES_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    x, dy = torch.randn(3, 300).to(dtype), torch.randn(3, 300).to(dtype)
    w = (1 + 0.5 * torch.randn(300)).to(dtype)
    y, rstd = triton_impl.rmsnorm_forward(x, w, 1e-6, torch.empty_like(x), torch.empty(3))
    dx, dw = triton_impl.rmsnorm_backward(x, w, rstd, dy, torch.empty_like(x), torch.empty_like(w))
    outputs = dict(x=x, w=w, dy=dy, y=y, rstd=rstd, dx=dx, dw=dw)
    calls.append({name: (str(t.dtype), t.tolist()) for name, t in outputs.items()})
print(json.dumps(calls))
"""


def fresh_interpreter_calls(script):
    """Run script in a fresh process under TRITON_INTERPRET=1 in this folder (no test.py, no
    common/); returns its printed calls, each a {name: tensor} dict rebuilt with its dtype."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return [
        {name: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))
         for name, (dtype, values) in call.items()}
        for call in json.loads(child.stdout)
    ]  # fmt: skip


def test_triton_kernels_run_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included) runs the forward and the backward on CPU tensors, bfloat16 and float32,
    within their bounds: the README's laptop command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        x, w, rstd = t["x"], t["w"], t["rstd"]
        exact_y, exact_rstd = reference.rmsnorm_forward(x, w, EPS)
        y_bound, rstd_bound = forward_bounds("triton", x, w, EPS, exact_y, exact_rstd)
        assert_within_bound(t["y"], exact_y, y_bound, "fresh y")
        assert_within_bound(rstd, exact_rstd, rstd_bound, "fresh rstd")
        exact_dx, exact_dw = reference.rmsnorm_backward(x, w, rstd, t["dy"], None, None)
        bounds = backward_bounds("triton", x, w, rstd, t["dy"], exact_dx, exact_dw)
        assert_within_bound(t["dx"], exact_dx, bounds[0], "fresh dx")
        assert_within_bound(t["dw"], exact_dw, bounds[1], "fresh dweight")
