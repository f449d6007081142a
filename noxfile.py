"""One nox session per kernel folder, named by the folder: `nox -s copy`, `nox -t blas`, `nox`.

Each session makes its own virtual environment from requirements.txt and runs the folder's
`python test.py`, exactly what a reader runs by hand after `cd copy`. `lint` runs ruff.
"""

from pathlib import Path

import nox

ROOT = Path(__file__).parent
BLAS = ["copy", "swap", "scal", "axpby", "dot", "gemv", "geru", "gemm"]
TRANSFORMER = []  # sub-folders of transformer/

nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True


def kernel_session(folder, tag):
    def run_tests(session):
        session.install("-r", str(ROOT / "requirements.txt"))
        session.chdir(ROOT / folder)
        session.run("python", "test.py")

    run_tests.__doc__ = f"Tests of {folder}/ (torch on the CPU, Triton interpreted, CuTe compiled)."
    nox.session(run_tests, name=Path(folder).name, tags=[tag])


for folder in BLAS:
    kernel_session(folder, "blas")
for folder in TRANSFORMER:
    kernel_session(f"transformer/{folder}", "transformer")


@nox.session
def lint(session):
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
