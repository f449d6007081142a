"""Write the measured numbers into the READMEs, from the files a GPU run leaves.

    python tools/results_table.py LOGS

LOGS is the `logs` folder of the archive tools/gpu-run writes: `<folder>.test.log`,
`<folder>.results.json` and `<folder>.perf.png` for each kernel folder. For each folder this
copies results.json and perf.png into the folder, rewrites the block between `<!-- results -->`
and `<!-- /results -->` in its README with the table at the largest size, and rewrites the
kernels table of the top-level README. An implementation gets its mark only if the folder's
test log on the GPU shows it passing and never failing.
"""

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name: (description, equation, flops, minimal data in elements)
KERNELS = {
    "copy": ("copy a vector", "y = x", "0", "2n"),
    "swap": ("exchange two vectors", "x <-> y", "0", "4n"),
    "scal": ("scale a vector", "y = alpha y", "n", "2n"),
    "axpby": ("scaled vector sum", "y = alpha x + beta y", "3n", "3n"),
    "dot": ("inner product", "z = x^T y", "2n", "2n"),
}
FILES = {"Python": "reference.py", "PyTorch": "torch_impl.py", "Triton": "triton_impl.py"}
FILES["CuTe"] = "cute_impl.py"
IMPL_OF = {"PyTorch": "torch", "Triton": "triton", "CuTe": "cute"}


def passing_impls(test_log):
    """Implementations that passed on the GPU: named in a PASSED line of the log (gpu-run runs
    pytest with -rA) and in no FAILED line. None if the run did not end in a passing summary
    or a failure names no implementation."""
    lines = test_log.read_text().strip().splitlines()
    if not lines or "passed" not in lines[-1]:
        return set()

    def named(line):
        # parameter ids look like [4097-torch.float32-triton]: an implementation sits between
        # '[' or '-' and '-' or ']'
        return {impl for impl in IMPL_OF.values() if re.search(rf"[\[-]{impl}[\]-]", line)}

    passed, failed = set(), set()
    for line in lines:
        if line.startswith("PASSED"):
            passed |= named(line)
        elif line.startswith("FAILED"):
            failed |= named(line) or set(IMPL_OF.values())
    return passed - failed


def largest_rows(results):
    largest = max(row["shape"][0] for row in results["rows"])
    return [row for row in results["rows"] if row["shape"][0] == largest], largest


def folder_table(results):
    rows, n = largest_rows(results)
    lines = [
        f"{results['device']}, n = 2**{n.bit_length() - 1}; copy ceiling measured in the same run: "
        f"{results['ceilings']['copy_GBps']:.0f} GB/s.",
        "",
        "| implementation | dtype | time (us) | GB/s | % of copy | vs torch |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['impl']} | {row['dtype']} | {row['ms'] * 1e3:.1f} | {row['GBps']:.0f} | "
            f"{row['pct_of_ceiling']:.1f} | {row['vs_library']:.2f} |"
        )
    lines += ["", "![GB/s against n](perf.png)"]
    return "\n".join(lines)


def replace_block(path, body):
    text = path.read_text()
    block = f"<!-- results -->\n{body}\n<!-- /results -->"
    new, count = re.subn(r"<!-- results -->.*?<!-- /results -->", block, text, flags=re.S)
    if count != 1:
        raise SystemExit(f"{path}: expected one <!-- results --> block")
    path.write_text(new)


def summary(results):
    """Best of Triton and CuTe as % of the copy ceiling, per dtype, at the largest size."""
    rows, _ = largest_rows(results)
    parts = []
    for dtype in dict.fromkeys(row["dtype"] for row in rows):
        best = {r["impl"]: r["pct_of_ceiling"] for r in rows if r["dtype"] == dtype}
        fused = [f"{impl} {best[impl]:.0f}%" for impl in ("triton", "cute") if impl in best]
        parts.append(f"{dtype}: " + ", ".join(fused))
    return "; ".join(parts)


def main(logs):
    table = [
        "| Name | Description | Equation | Flops | Data | Python | PyTorch | Triton | CuTe | Test "
        "| H200 (% of copy, largest size) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (description, equation, flops, data) in KERNELS.items():
        folder = ROOT / name
        results_file, test_log = logs / f"{name}.results.json", logs / f"{name}.test.log"
        if not results_file.exists() or not test_log.exists():
            raise SystemExit(f"{logs}: no results or test log for {name}")
        shutil.copy(results_file, folder / "results.json")
        shutil.copy(logs / f"{name}.perf.png", folder / "perf.png")
        results = json.loads(results_file.read_text())
        replace_block(folder / "README.md", folder_table(results))
        passing = passing_impls(test_log)
        marks = []
        for column, file in FILES.items():
            passed = column == "Python" or IMPL_OF[column] in passing
            marks.append(f"[✓]({name}/{file})" if passed else "")
        table.append(
            f"| [{name}]({name}/README.md) | {description} | `{equation}` | {flops} | {data} | "
            + " | ".join(marks)
            + f" | [test.py]({name}/test.py) | {summary(results)} |"
        )
    replace_block(ROOT / "README.md", "\n".join(table))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
