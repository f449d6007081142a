"""GPU probe for layernorm: the test suite, then bench.py's two quick shapes, in one run.

    cd transformer/layernorm && python probe.py

Prints a summary and writes it to $OUT/layernorm_probe.json when OUT is set. Each part is
caught and reported on its own, so a failure in one does not hide the other. The PTX and build
tests, already run on the CPU, are left out to keep the CuTe compiles few.
"""

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_tests():
    start = time.time()
    done = subprocess.run(
        [sys.executable, "test.py", "-q", "-rfs", "-k", "not ptx and not build"],
        cwd=HERE, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    tail = (done.stdout + done.stderr).strip().splitlines()
    return {"rc": done.returncode, "seconds": round(time.time() - start, 1), "tail": tail[-30:]}


def run_bench():
    sys.path.insert(0, str(HERE))
    import bench

    results = bench.main(quick=True)
    return [
        {k: row[k] for k in ("impl", "pass", "dtype", "shape", "ms", "pct_of_ceiling")}
        for row in results["rows"]
    ] + [{"copy_GBps": results["ceilings"]["copy_GBps"]}]


def main():
    summary = {}
    for name, part in (("tests", run_tests), ("bench", run_bench)):
        try:
            summary[name] = part()
        except Exception:
            summary[name] = {"error": traceback.format_exc()[-3000:]}
    text = json.dumps(summary, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "layernorm_probe.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
