"""GPU probe for rmsnorm: the full test suite (at most TESTS_TIMEOUT_S), then bench.py --quick
(the two headline shapes, bf16 and float32), in one run.

    cd transformer/rmsnorm && python probe.py

Prints a summary and writes it to $OUT/rmsnorm_probe.json when OUT is set. Each part is caught
and reported on its own, so a failure in one does not hide the other.
"""

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS_TIMEOUT_S = 120


def run_tests():
    """The whole suite, verbose: each test's name and outcome print as it ends, so a suite
    stopped at TESTS_TIMEOUT_S still names its failures (pytest's details come at the end).
    Each line is stamped with the seconds since the start: the slowest steps show where the
    time went."""
    start = time.time()
    command = [sys.executable, "test.py", "-vv", "-rfEs", "-s"]  # test.py passes -q: -vv nets -v
    with subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as child:  # fmt: skip
        stop = threading.Timer(TESTS_TIMEOUT_S, child.kill)
        stop.start()
        stamped = [(time.time() - start, line.rstrip()) for line in child.stdout]
        stop.cancel()
    times = [0.0] + [t for t, _ in stamped]
    steps = [(times[i + 1] - times[i], line) for i, (_, line) in enumerate(stamped)]
    return {
        "rc": "timeout" if child.returncode < 0 else child.returncode,
        "seconds": round(time.time() - start, 1),
        "failed": [line for _, line in stamped if " FAILED" in line or " ERROR" in line][:80],
        "slowest": [f"{dt:.1f} s {line}" for dt, line in sorted(steps, reverse=True)[:10]],
        "tail": [line for _, line in stamped[-25:]],
    }


def run_bench():
    sys.path.insert(0, str(HERE))
    import bench

    results = bench.main(quick=True)
    return [
        {k: row[k] for k in ("impl", "pass", "dtype", "shape", "ms", "pct_of_ceiling", "timing")}
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
        Path(os.environ["OUT"], "rmsnorm_probe.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
