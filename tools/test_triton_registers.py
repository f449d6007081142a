"""triton_registers on a kernel made up here (CPU only: `pytest tools`; needs ptxas)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_registers  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")


@triton.jit
def double_kernel(x_ptr, y_ptr, n, stride_xm, stride_xn, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * stride_xm + tl.arange(0, BLOCK) * stride_xn
    x = tl.load(x_ptr + offs, mask=tl.arange(0, BLOCK) < n)
    tl.store(y_ptr + offs, x * 2, mask=tl.arange(0, BLOCK) < n)


def test_counts_the_aligned_build():
    """The launcher's specialisation: aligned pointers, n and the row stride multiples of 16
    and a unit column stride give 128-bit loads (8 bf16 a thread: one ld.global.v4), no spill."""
    counts = triton_registers.count(double_kernel, 4, "bf16", (), {"BLOCK": 1024})
    assert counts["v4_loads"] == 1 and counts["spill_bytes"] == 0
    assert 0 < counts["registers"] <= 255 and counts["barriers"] == 0


def test_without_alignment_the_loads_are_scalar(monkeypatch):
    """The negative control: the same kernel with nothing known about alignment loads element
    by element, the build the docstring warns against."""
    plain = triton_registers.signature_of

    def unaligned(*args):
        signature, constants, _ = plain(*args)
        return signature, constants, []

    monkeypatch.setattr(triton_registers, "signature_of", unaligned)
    assert triton_registers.count(double_kernel, 4, "bf16", (), {"BLOCK": 1024})["v4_loads"] == 0


def test_maxnreg_caps_the_registers():
    counts = triton_registers.count(double_kernel, 4, "bf16", (), {"BLOCK": 8192}, maxnreg=32)
    assert counts["registers"] <= 32


def test_a_missing_constant_is_named():
    with pytest.raises(SystemExit, match="BLOCK"):
        triton_registers.count(double_kernel, 4)
