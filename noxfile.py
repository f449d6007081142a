"""One nox session per kernel folder, named by the folder: `nox -s copy`, `nox -t blas`, `nox`.

Every kernel session runs the folder's `python test.py`, exactly what a reader runs by hand after
`cd copy`, in one virtual environment shared by all of them: `.nox/course`, made from
requirements.txt by the first session that needs it and made again when requirements.txt changes.
torch, Triton and the CuTe DSL take about 1.8 GB installed; a copy per session (nine of them)
filled a CI machine's disk. `lint` runs ruff in its own small environment.
"""

import hashlib
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
BLAS = ["copy", "swap", "scal", "axpby", "dot", "gemv", "geru", "gemm"]
# sub-folders of transformer/
TRANSFORMER = ["softmax", "rmsnorm", "layernorm", "swiglu", "rope", "cross_entropy", "attention"]

COURSE_ENV = ROOT / ".nox" / "course"
REQUIREMENTS = ROOT / "requirements.txt"

nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True


def course_python(session):
    """The shared environment's python, built (or rebuilt) when requirements.txt has changed."""
    stamp = COURSE_ENV / "requirements.sha256"
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    python = COURSE_ENV / "bin" / "python"
    if not (stamp.exists() and stamp.read_text() == wanted and python.exists()):
        shutil.rmtree(COURSE_ENV, ignore_errors=True)
        session.run(sys.executable, "-m", "venv", str(COURSE_ENV), external=True)
        session.run(
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "-r",
            str(REQUIREMENTS),
            external=True,
        )
        stamp.write_text(wanted)  # written last: an interrupted install is redone next time
    return str(python)


def kernel_session(folder, tag):
    def run_tests(session):
        python = course_python(session)
        session.chdir(ROOT / folder)
        session.run(python, "test.py", external=True)

    run_tests.__doc__ = f"Tests of {folder}/ (torch on the CPU, Triton interpreted, CuTe compiled)."
    nox.session(run_tests, name=Path(folder).name, tags=[tag], venv_backend="none")


for folder in BLAS:
    kernel_session(folder, "blas")
for folder in TRANSFORMER:
    kernel_session(f"transformer/{folder}", "transformer")


@nox.session(venv_backend="none")
def tools(session):
    """Tests of tools/ (the GPU runner's ledger, the README tables' writer), on the CPU."""
    python = course_python(session)
    session.run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tools", external=True)


@nox.session
def lint(session):
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
