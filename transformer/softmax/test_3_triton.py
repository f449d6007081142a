"""Softmax tests, section (3): Triton's looped kernels, dispatch, launches and interpreter.
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
    HERE,
    backward_bound,
    check,
    forward_bound,
    forward_then_backward,
    random_rows,
    special_rows,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import reference
import triton_impl
from common.tolerance import assert_within_bound

# (3) Triton: the looped kernels and the dispatch between the two kernel shapes ---------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [33, 100, 257])
def test_triton_looped_kernels(dtype, n, monkeypatch):
    """With the register limits at 32 and chunks of 16 lanes, short rows take the looped
    kernels (online max and sum over several chunks, the second pass last chunk first): the
    path the H200 takes past ROW_BLOCK_MAX, at sizes the interpreter runs."""
    monkeypatch.setattr(triton_impl, "ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "BACKWARD_ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "CHUNK", 16)
    x = random_rows(3, n, dtype)
    x[0, :20] = float("-inf")  # a first chunk of -inf only: the online rescale must not NaN
    x[1, 40:] = float("-inf")
    forward_then_backward("triton", x, random_rows(3, n, dtype))
    assert triton_impl.forward_path(n, dtype)[0] == -(-n // 16) + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_looped_special_values(dtype, monkeypatch):
    """test_special_values on the looped kernels (chunks of 16 lanes): the NaN in chunk 9 and
    the +inf in chunk 1 meet a running max that ignores NaN on the GPU (max.f32) and still
    make their rows NaN through the sum; a row of -inf, and one whose first 18 chunks are all
    -inf (the online rescale of an empty lane: exp(-inf - 0) = 0, never -inf - -inf), follow
    the definition, as torch does."""
    monkeypatch.setattr(triton_impl, "ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "BACKWARD_ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "CHUNK", 16)
    x = special_rows(dtype)
    y = check("triton", "forward", x)
    assert torch.equal(y.isnan(), torch.softmax(x.double(), dim=-1).isnan())
    assert y[[0, 4, 5, 6]].isfinite().all() and y[[1, 2, 3]].isnan().all()
    finite = y[[0, 4, 5, 6]]
    check("triton", "backward", finite, random_rows(*finite.shape, dtype))


def test_triton_dispatch():
    """Rows up to ROW_BLOCK_MAX go to the rows kernel, several short rows per program."""
    grid, constants = triton_impl.rows_launch(1000, 1, 32768)
    assert grid == (1,) and (constants["ROWS"], constants["BLOCK_N"]) == (1024, 1)
    assert triton_impl.rows_launch(3, 100, 32768)[1]["ROWS"] == 4  # never more than m needs
    grid, constants = triton_impl.rows_launch(8, 32768, 32768)
    assert grid == (8,) and (constants["ROWS"], constants["BLOCK_N"]) == (1, 32768)
    assert constants["num_warps"] == 32
    assert triton_impl.rows_launch(8, 32769, 32768) is None
    # The forward holds one operand, 32 elements a thread; the backward two, 16 a thread.
    forward = triton_impl.rows_launch(8, 16384, 32768, triton_impl.FORWARD_ELEMS_PER_THREAD)
    assert forward[1]["num_warps"] == 16
    assert triton_impl.rows_launch(8, 16384, 16384)[1]["num_warps"] == 32


def test_triton_looped_at_real_size():
    """N = 40000 > ROW_BLOCK_MAX at the real constants: 10 chunks of 4096 lanes."""
    forward_then_backward("triton", *(random_rows(2, 40000, torch.bfloat16) for _ in "xy"))


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    rows past ROW_BLOCK_MAX (the looped kernels). The stand-ins compute nothing."""

    def both(x):
        y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
        return lambda: (triton_impl.softmax_forward(x, y), triton_impl.softmax_backward(y, dy, dx))

    for dtype in DTYPES:
        yield both(random_rows(4, 96, dtype))
    yield both(random_rows(4, 1000, torch.float32))
    yield both(random_rows(1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96])
    yield both(torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96))
    yield both(random_rows(2, 40000, torch.bfloat16))


# 8 cases of two launches; the backwards after the strided and the misaligned x see only
# contiguous, aligned operands (empty_like), as the float32 case's does.
MIN_SPECIALISATIONS = 14

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


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    x, dy = torch.randn(3, 300).to(dtype), torch.randn(3, 300).to(dtype)
    y = triton_impl.softmax_forward(x, torch.empty_like(x))
    dx = triton_impl.softmax_backward(y, dy, torch.empty_like(x))
    outputs = dict(x=x, dy=dy, y=y, dx=dx)
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
        exact = reference.softmax_forward(t["x"])
        assert_within_bound(t["y"], exact, forward_bound("triton", t["x"], exact), "fresh y")
        exact = reference.softmax_backward(t["y"], t["dy"])
        bound = backward_bound("triton", t["y"], t["dy"], exact)
        assert_within_bound(t["dx"], exact, bound, "fresh dx")
