"""The sm_90a PTX of every kernel a folder's CPU test suite launches, to show a refactor kept it.

    python tools/ptx_snapshot.py FOLDER OUT [PYTEST ARGS...]
    diff -r OUT_BEFORE OUT_AFTER        # empty: every kernel compiles to the same PTX

It runs FOLDER's tests (test.py and its section files test_*.py) under pytest as `python test.py`
does on a machine without a GPU (Triton under its interpreter, CuTe compiled for sm_90a), and on
top of that:

- each Triton launch is also compiled for sm_90a (the interpreter never compiles): the kernel is
  specialised on the launch's arguments as a GPU launch would be (dtypes, 16-byte alignment,
  integers equal to 1 or divisible by 16, constexprs), and its PTX is kept;
- each cute.compile that keeps its PTX (the suite's sm_90a builds do) leaves it here too.

It compares what the CPU suite builds: the Triton specialisations it launches and the CuTe builds
it compiles. When a refactor changes test.py as well, run both versions under one test.py (say the
old one, checked out over the new for the second run), so that both launch the same set.

OUT gets one file per distinct PTX text, `triton/<kernel>.<hash>.ptx` and
`cute/<kernel>.<hash>.ptx`, without line-number information (Triton compiles with
TRITON_DISABLE_LINE_INFO; `.loc`, `.file`, comments and debug sections are removed), since moving
a docstring moves every line, and `kernels.txt`, the sorted list. Test results do not matter here
(they are the suite's own business); a launch whose compilation fails is listed as such.
"""

import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

LINE_INFO = re.compile(r"^\s*(\.loc|\.file)\b.*$|^\s*//.*$", re.MULTILINE)
DEBUG_SECTIONS = re.compile(
    r"^\s*\.section\s+\.debug_\w+\s*\{.*?^\s*\}\s*$", re.MULTILINE | re.DOTALL
)


def without_line_info(ptx):
    """PTX minus what moves with source lines: .loc/.file directives, comments, debug sections."""
    ptx = DEBUG_SECTIONS.sub("", ptx)
    ptx = LINE_INFO.sub("", ptx)
    return "\n".join(line.rstrip() for line in ptx.splitlines() if line.strip()) + "\n"


def keep(out, kind, name, ptx, listing):
    text = without_line_info(ptx)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = out / kind / f"{name}.{digest}.ptx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    listing.add(f"{kind} {name} {digest}")


def record_triton_launches(out, listing):
    """Patch the interpreter: each launch also compiles its kernel for sm_90a and keeps the PTX."""
    import triton
    import triton.experimental.gluon  # noqa: F401 - imported now: it refuses interpreted functions later
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, interpreter
    from triton.runtime.errors import InterpreterError
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        """What JITFunction.run asks of a driver to compile only: a device, a stream, a target."""

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    twins = {}  # InterpretedFunction -> its JITFunction

    def twin(interpreted):
        if interpreted not in twins:
            twins[interpreted] = JITFunction(interpreted.fn, **interpreted.kwargs)
        return twins[interpreted]

    def swap_globals(fn):
        """Point fn's module, the modules of the @triton.jit functions it reaches (a kernel may
        call helpers from another file) and triton.language at JIT twins of their @triton.jit
        functions while fn compiles (under the interpreter every @triton.jit, tl.sum's included,
        is interpreted)."""
        namespaces = [fn.__globals__] + [
            vars(module)
            for name, module in list(sys.modules.items())
            if name.startswith("triton.language")
        ]
        saved = []
        for namespace in namespaces:  # grows as helpers from other modules turn up
            interpreted = {k: v for k, v in namespace.items() if isinstance(v, InterpretedFunction)}
            namespace.update({k: twin(v) for k, v in interpreted.items()})
            saved.append((namespace, interpreted))
            for helper in interpreted.values():
                if not any(helper.fn.__globals__ is seen for seen in namespaces):
                    namespaces.append(helper.fn.__globals__)
        return saved

    interpret = InterpretedFunction.run
    kept = set()  # the compiled kernels already kept: Triton's cache returns the same one again

    def run_and_compile(self, *args, grid, warmup, **kwargs):
        saved = swap_globals(self.fn)
        interpreting, active = triton.knobs.runtime.interpret, driver._active
        driver.set_active(CompileOnlyDriver())
        triton.knobs.runtime.interpret = False
        try:
            kernel = twin(self).run(*args, grid=grid, warmup=True, **kwargs)
            if kernel not in kept:
                kept.add(kernel)
                keep(out, "triton", self.fn.__name__, kernel.asm["ptx"], listing)
        except Exception as error:  # noqa: BLE001 - listed, so a before/after diff shows it
            if os.environ.get("PTX_SNAPSHOT_DEBUG"):
                import traceback

                traceback.print_exc()
            listing.add(f"triton {self.fn.__name__} failed-to-compile {type(error).__name__}")
        finally:
            triton.knobs.runtime.interpret = interpreting
            driver._active = active
            for namespace, interpreted in saved:
                namespace.update(interpreted)
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    def call_and_restore(self, *args, **kwargs):
        """A @triton.jit helper called by an interpreted kernel. Triton 3.6 patches triton.language
        for it and never restores it (harmless to the interpreter, fatal to a later compile)."""
        scope = interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise InterpreterError(repr(error)) from error
        finally:
            scope.restore()

    InterpretedFunction.run, InterpretedFunction.__call__ = run_and_compile, call_and_restore


def record_cute_compilations(out, listing):
    """Wrap cute.compile so that each compilation's PTX is kept (CUTE_DSL_KEEP=ptx keeps it)."""
    try:
        from cutlass import cute
    except ImportError:
        return
    compile_ = cute.compile

    def compile_and_keep(fn, *args, **kwargs):
        compiled = compile_(fn, *args, **kwargs)
        ptx = getattr(compiled, "__ptx__", None)
        name = getattr(fn, "__name__", type(fn).__name__)
        if ptx:
            keep(out, "cute", name, ptx, listing)
        else:
            listing.add(f"cute {name} no-ptx-kept")
        return compiled

    cute.compile = compile_and_keep


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    folder, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        TRITON_INTERPRET="1",
        TRITON_DISABLE_LINE_INFO="1",
        CUTE_DSL_ARCH="sm_90a",
        CUTE_DSL_KEEP="ptx",
        CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="cute-ptx-"),
    )
    listing = set()
    record_triton_launches(out, listing)
    record_cute_compilations(out, listing)
    os.chdir(folder)
    sys.path[:0] = [str(folder), str(folder.parent)]
    import pytest

    tests = ["test.py", *sorted(path.name for path in folder.glob("test_*.py"))]
    pytest.main(["-q", "-p", "no:cacheprovider", *tests, *sys.argv[3:]])
    (out / "kernels.txt").write_text("".join(f"{line}\n" for line in sorted(listing)))
    print(f"{len(listing)} kernels -> {out}")


if __name__ == "__main__":
    main()
