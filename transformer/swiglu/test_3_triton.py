"""SwiGLU tests, section (3): Triton's tiles, launches, sm_90 build and interpreter.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test import DEVICE, DTYPES, HERE, ON_GPU, backward_bounds, forward_bound, operands, random_rows
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import reference
import torch_impl
import triton_impl
from common.tolerance import assert_within_bound

# (3) Triton: the tiles, and the sm_90 build ------------------------------------------------


def test_triton_tiles():
    """Tiles of a pass's element count: short rows packed several to a tile, never more rows
    than m, long rows split along N; every dtype and pass has a tile, a power of two."""
    assert triton_impl.tile_of(1000, 1, 4096) == (1024, 1, 1)
    assert triton_impl.tile_of(3, 100, 4096) == (4, 128, 1)
    assert triton_impl.tile_of(16384, 14336, 4096) == (1, 4096, 4)
    assert triton_impl.tile_of(16384, 14336, 2048) == (1, 2048, 7)
    assert triton_impl.launch_grid(16384, 14336, (4096, 8))[0] == (65536,)
    assert triton_impl.launch_grid(16384, 14336, (4096, 8))[2]["num_warps"] == 8
    for direction in ("forward", "backward"):
        for dtype in DTYPES:
            elems, warps = triton_impl.TILES[direction, dtype.itemsize]
            assert elems & (elems - 1) == 0 and elems % (32 * warps) == 0


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    the fused gate-up tensor (u's address is g's plus n elements), rows longer than a tile.
    The stand-ins compute nothing."""

    def both(g, u=None):
        y = torch_impl.fresh_output(g, u)
        dy = torch.randn_like(y)
        dg, du = torch.empty_like(g), None if u is None else torch.empty_like(u)
        return lambda: (
            triton_impl.swiglu_forward(g, u, y),
            triton_impl.swiglu_backward(g, u, dy, dg, du),
        )

    for dtype in DTYPES:
        yield both(*operands("separate", 4, 96, dtype))
    yield both(*operands("separate", 4, 1000, torch.float32))
    yield both(*operands("separate", 1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96], random_rows(4, 96, torch.float32))
    yield both(
        torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96), random_rows(4, 96, torch.float32)
    )
    yield both(*operands("fused", 4, 100, torch.bfloat16))
    yield both(*operands("separate", 2, 10000, torch.bfloat16))


# 9 cases of two launches, each a key of its own (g, strided or misaligned, is the backward's
# input too).
MIN_SPECIALISATIONS = 18

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


# Builds both kernels for sm_90 in a child process (under TRITON_INTERPRET=1 they cannot be
# compiled): once with every int argument the constant 1 (what a launch at M = N = 1 does), and
# once as the H200 sees a bf16 (or float32) launch of aligned rows, whose PTX must load and
# store 128 bits at a time, call ex2.approx once and div.rn once per element, and not spill.
TRITON_BUILD_SCRIPT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

def build(kernel, dtype, ones, tile):
    names = [p.name for p in kernel.params]
    kinds = {p.name: "constexpr" if p.is_constexpr else "*" + dtype if p.name.endswith("_ptr")
             else "i32" for p in kernel.params}
    constexprs = {"ROWS": 1, "BLOCK_N": tile[0]}
    unit = [n for n in names if kinds[n] == "i32" and (ones or n.endswith("n") and
            n.startswith("stride"))]
    constexprs.update({n: 1 for n in unit})
    aligned = [n for n in names if n not in unit and kinds[n] != "constexpr" and n != "m"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(kernel, kinds, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile[1]}).asm["ptx"]

for kernel, loads, stores in ((t.swiglu_forward_kernel, 2, 1), (t.swiglu_backward_kernel, 3, 2)):
    direction = kernel.fn.__name__.split("_")[1]
    build(kernel, "fp32", ones=True, tile=t.TILES[direction, 4])
    for dtype, size in (("bf16", 2), ("fp32", 4)):
        tile = t.TILES[direction, size]
        ptx = build(kernel, dtype, ones=False, tile=tile)
        per_thread = tile[0] // (32 * tile[1])
        vectors = per_thread * size // 16
        count = lambda op: len(re.findall(op, ptx))
        found = (count(r"ld\\.global\\.v4"), count(r"st\\.global\\.v4"), count(r"ex2\\.approx"),
                 count(r"div\\.rn\\.f32"), count(r"\\.local"))
        expected = (loads * vectors, stores * vectors, per_thread, per_thread, 0)
        assert found == expected, (kernel.fn.__name__, dtype, found, expected)
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch these builds")
def test_triton_builds_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_BUILD_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    g, u = (3 * torch.randn(3, 300)).to(dtype), (3 * torch.randn(3, 300)).to(dtype)
    dy = torch.randn(3, 300).to(dtype)
    y = triton_impl.swiglu_forward(g, u, torch.empty_like(g))
    dg, du = triton_impl.swiglu_backward(g, u, dy, torch.empty_like(g), torch.empty_like(u))
    outputs = dict(g=g, u=u, dy=dy, y=y, dg=dg, du=du)
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
        g, u, dy = t["g"], t["u"], t["dy"]
        exact = reference.swiglu_forward(g, u)
        assert_within_bound(t["y"], exact, forward_bound("triton", g, u, exact), "fresh y")
        exact_dg, exact_du = reference.swiglu_backward(g, u, dy)
        dg_bound, du_bound = backward_bounds("triton", g, u, dy, exact_dg, exact_du)
        assert_within_bound(t["dg"], exact_dg, dg_bound, "fresh dg")
        assert_within_bound(t["du"], exact_du, du_bound, "fresh du")
