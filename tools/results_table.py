"""Write the measured numbers into the READMEs, from the files a GPU run leaves.

    python tools/results_table.py LOGS

LOGS is the `logs` folder of the archive tools/gpu-run writes: `<folder>.test.log`,
`<folder>.results.json` and `<folder>.perf.png` for each kernel folder. For each folder this
copies results.json and perf.png into the folder, rewrites the block between `<!-- results -->`
and `<!-- /results -->` in its README with the table at the largest size, and rewrites the
kernels table of the top-level README (a folder with nothing in LOGS keeps the row it has, or
is listed unmarked if it has none, so one run may cover some folders only). An
implementation gets its mark only if the folder's test log on the GPU shows it passing and never
failing."""

import json
import re
import shutil
import sys
from pathlib import Path

from results_format import folder_table, step_table, summary

ROOT = Path(__file__).resolve().parent.parent
# name: (description, equation, flops, minimal data in elements)
KERNELS = {
    "copy": ("copy a vector", "y = x", "0", "2n"),
    "swap": ("exchange two vectors", "x <-> y", "0", "4n"),
    "scal": ("scale a vector", "y = alpha y", "n", "2n"),
    "axpby": ("scaled vector sum", "y = alpha x + beta y", "3n", "3n"),
    "dot": ("inner product", "z = x^T y", "2n", "2n"),
    "gemv": ("matrix-vector product", "y = alpha A x + beta y", "2mn", "mn + n + 2m"),
    "geru": ("rank-1 update", "A = A + alpha x y^T", "2mn", "2mn + m + n"),
    "gemm": ("matrix product", "C = alpha A B + beta C", "2mnk", "mk + kn + 2mn"),
}
# Transformer modules, in transformer/<name>/: forward and backward. M rows of N elements; data in
# elements, forward + backward (the backward of softmax needs y, of the norms x and the statistics).
MODULES = {
    "softmax": ("normalised exponentials of each row", "y = exp(x - max x) / sum exp(x - max x)",
                "5MN + 4MN", "2MN + 3MN"),
    "rmsnorm": ("root-mean-square norm, scaled", "y = x w / sqrt(mean x^2 + eps)",
                "4MN + 8MN", "2MN + 3MN"),
    "layernorm": ("mean and variance norm, scaled and shifted",
                  "y = (x - mean x) w / sqrt(var x + eps) + b", "8MN + 11MN", "2MN + 3MN"),
    "swiglu": ("gated linear unit of the Llama MLP", "y = silu(g) u = g u / (1 + exp(-g))",
               "6MN + 12MN", "3MN + 5MN"),
    "rope": ("rotary position embedding of q and k",
             "(y_a, y_b) = (x_a cos - x_b sin, x_b cos + x_a sin)", "3T + 3T",
             "2T + 2T (T = B S (H + Hk) D)"),
    "cross_entropy": ("loss of each row's target class", "loss = logsumexp(x) - x[target]",
                      "4MV + 5MV", "MV + 2MV"),
    "attention": ("softmax attention, fused (FlashAttention)",
                  "O = softmax(Q K^T scale + mask) V", "4BHS^2D + 10BHS^2D",
                  "4BSHD + 8BSHD (K, V: H_kv heads)"),
}  # fmt: skip
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
        # (a step of a lesson in steps, cute.step1, counts as its implementation)
        return {
            impl for impl in IMPL_OF.values() if re.search(rf"[\[-]{impl}(\.step\d+)?[\]-]", line)
        }

    passed, failed = set(), set()
    for line in lines:  # -rA's summary lines ("PASSED test.py::...") or -v's ("... PASSED [ 5%]")
        if line.startswith("PASSED") or re.search(r"::\S+ PASSED", line):
            passed |= named(line)
        elif line.startswith("FAILED") or re.search(r"::\S+ FAILED", line):
            failed |= named(line) or set(IMPL_OF.values())
    return passed - failed


def replace_block(path, body, name="results"):
    text = path.read_text()
    block = f"<!-- {name} -->\n{body}\n<!-- /{name} -->"
    new, count = re.subn(rf"<!-- {name} -->.*?<!-- /{name} -->", block, text, flags=re.S)
    if count != 1:
        raise SystemExit(f"{path}: expected one <!-- {name} --> block")
    path.write_text(new)


def current_rows():
    """{kernel name: its row} of the kernels table in the top-level README, as it stands."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        found = re.match(r"\| \[(\w+)\]\((?:transformer/)?\1/README\.md\) \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def kernel_row(logs, path, description, equation, flops, data, kept):
    """The top-level README's row of the folder at `path` (relative to the root), with the
    folder's results.json, perf.png and README tables updated from LOGS on the way."""
    name, folder, log = Path(path).name, ROOT / path, path.replace("/", "_")
    results_file, test_log = logs / f"{log}.results.json", logs / f"{log}.test.log"
    head = f"| [{name}]({path}/README.md) | {description} | `{equation}` | {flops} | {data} | "
    if not test_log.exists():
        if name in kept:
            print(f"{path}: no test log in {logs}; its row is kept as it was")
            return kept[name]
        print(f"{path}: no test log in {logs}; listed as not yet run on the H200")
        return head + f"[✓]({path}/reference.py) | | | | [test.py]({path}/test.py) | not yet run |"
    measured = "bench.py not yet complete on the H200 (README.md, Measured)"
    if results_file.exists():
        shutil.copy(results_file, folder / "results.json")
        shutil.copy(logs / f"{log}.perf.png", folder / "perf.png")
        results = json.loads(results_file.read_text())
        replace_block(folder / "README.md", folder_table(results))
        steps = step_table(results, folder)
        if steps is not None:
            replace_block(folder / "README.md", steps, "steps")
        measured = summary(results)
    passing = passing_impls(test_log)
    marks = []
    for column, file in FILES.items():
        passed = column == "Python" or IMPL_OF[column] in passing
        marks.append(f"[✓]({path}/{file})" if passed else "")
    return head + " | ".join(marks) + f" | [test.py]({path}/test.py) | {measured} |"


def main(logs):
    kept = current_rows()
    columns = (
        "| Name | Description | Equation | Flops | Data | Python | PyTorch | Triton | CuTe | Test "
    )
    rule = "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    table = [
        columns + "| H200: % of copy bandwidth at the largest size (gemm: % of cuBLAS) |",
        rule,
    ]
    table += [kernel_row(logs, name, *about, kept) for name, about in KERNELS.items()]
    replace_block(ROOT / "README.md", "\n".join(table))
    modules = [
        columns
        + "| H200: % of copy bandwidth at the largest size, fwd and fwd+bwd (attention: TFLOP/s) |",
        rule,
    ]
    modules += [
        kernel_row(logs, f"transformer/{name}", *about, kept)
        for name, about in MODULES.items()
        if (ROOT / "transformer" / name).is_dir()  # a module lands with its folder
    ]
    replace_block(ROOT / "README.md", "\n".join(modules), "transformer")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
