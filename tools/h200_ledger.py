"""Which tests of a folder passed on the H200, for the code as it is now (used by tools/gpu-run).

A GPU call is short (minutes) and a folder's suite can take longer, so a suite is run over
several calls, and a call should not rerun what already passed on the same code. The ledger
tools/h200-passed/<folder, / as _>.ids records, for one fingerprint of the folder's code, the
test ids that passed on the H200:

    # <fingerprint> <date of the last call> <the devices of the calls, comma-separated>
    test_5_gpu.py::test_gemm_against_float64[bf16-4096]
    ...

The fingerprint is a sha256 over every .py file of the folder and of common/ (names and bytes):
any change to a kernel, a launcher or a test makes the old ledger stale, and then every test
runs again. README.md and results.json are left out: the tests do not read them.

    h200_ledger.py todo FOLDER COLLECTED LEDGER      the collected ids not in a current ledger
    h200_ledger.py record FOLDER LEDGER DEVICE LOG.. a current ledger (to stdout): the old one's
                                                     ids if current, and every id a log PASSED
"""

import datetime
import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A pytest -vv result line: "test_x.py::test_name[params] PASSED   [ 12%]".
RESULT_LINE = re.compile(r"^(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def fingerprint(folder):
    digest = hashlib.sha256()
    for directory in (ROOT / folder, ROOT / "common"):
        for path in sorted(directory.glob("*.py")):
            digest.update(f"{path.relative_to(ROOT)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def current_ledger(folder, ledger):
    """(ids, devices) of the ledger if it was written for the folder's code as it is now."""
    path = Path(ledger)
    if not path.is_file():
        return [], []
    header, *ids = path.read_text().splitlines()
    _, written_for, _, devices = header.split()
    if written_for != fingerprint(folder):
        return [], []
    return ids, [] if devices == "-" else devices.split(",")


def passed_ids(logs):
    """The ids some log reports PASSED and none FAILED or ERROR (a teardown can fail after)."""
    results = {}
    for log in filter(Path.is_file, map(Path, logs)):
        for line in log.read_text(errors="replace").splitlines():
            if match := RESULT_LINE.match(line):
                results.setdefault(match.group(1), set()).add(match.group(2))
    return [i for i, seen in results.items() if "PASSED" in seen and not seen & {"FAILED", "ERROR"}]


def main(command, folder, *args):
    if command == "todo":
        collected, ledger = args
        done = set(current_ledger(folder, ledger)[0])
        for test_id in Path(collected).read_text().splitlines():
            if test_id and test_id not in done:
                print(test_id)
    elif command == "record":
        ledger, device, *logs = args
        old_ids, devices = current_ledger(folder, ledger)
        new_ids = passed_ids(logs)
        if new_ids and device.replace(" ", "_") not in devices:
            devices.append(device.replace(" ", "_"))
        today = datetime.date.today().isoformat()
        print(f"# {fingerprint(folder)} {today} {','.join(devices) or '-'}")
        for test_id in sorted(set(old_ids) | set(new_ids)):
            print(test_id)
    else:
        raise SystemExit(f"unknown command {command!r}: todo or record")


if __name__ == "__main__":
    main(*sys.argv[1:])
