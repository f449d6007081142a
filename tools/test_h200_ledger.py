"""h200_ledger on a folder made up here (CPU only: `pytest tools`)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_ledger  # noqa: E402

LOG = """\
test.py::test_a[bf16] PASSED                                             [ 25%]
test.py::test_b PASSED                                                   [ 50%]
test.py::test_b ERROR                                                    [ 50%]
test_2_x.py::test_c[a b] FAILED                                          [ 75%]
test_2_x.py::test_d[with spaces in it] PASSED                            [100%]
PASSED test.py::test_a[bf16]
"""


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course root with one folder (kern/) and common/, the ledger reading from it."""
    for path, text in (("kern/impl.py", "x = 1\n"), ("common/tolerance.py", "t = 2\n")):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.setattr(h200_ledger, "ROOT", tmp_path)
    (tmp_path / "run.log").write_text(LOG)
    return tmp_path


def record(course, capsys, ledger, device="NVIDIA H200"):
    h200_ledger.main("record", "kern", str(ledger), device, str(course / "run.log"))
    (course / "new.ids").write_text(capsys.readouterr().out)
    return course / "new.ids"


def test_record_keeps_what_passed_and_nothing_that_failed_or_errored(course, capsys):
    header, *ids = record(course, capsys, course / "none.ids").read_text().splitlines()
    assert ids == ["test.py::test_a[bf16]", "test_2_x.py::test_d[with spaces in it]"]
    assert header.split()[1] == h200_ledger.fingerprint("kern")
    assert header.split()[3] == "NVIDIA_H200"


def test_todo_skips_the_current_ledger_and_nothing_of_a_stale_one(course, capsys):
    ledger = record(course, capsys, course / "none.ids")
    collected = course / "all"
    collected.write_text("test.py::test_a[bf16]\ntest.py::test_b\n\n")
    h200_ledger.main("todo", "kern", str(collected), str(ledger))
    assert capsys.readouterr().out == "test.py::test_b\n"
    for changed in ("kern/impl.py", "common/tolerance.py"):  # the folder's code or common/
        (course / changed).write_text((course / changed).read_text() + "# changed\n")
        h200_ledger.main("todo", "kern", str(collected), str(ledger))
        assert capsys.readouterr().out == "test.py::test_a[bf16]\ntest.py::test_b\n"
        ledger = record(course, capsys, course / "none.ids")


def test_record_adds_to_a_current_ledger_and_names_every_device(course, capsys):
    first = record(course, capsys, course / "none.ids")
    (course / "first.ids").write_text(first.read_text() + "test_3.py::test_old\n")
    (course / "run.log").write_text("test.py::test_b PASSED [100%]\n")
    header, *ids = (
        record(course, capsys, course / "first.ids", "NVIDIA H100").read_text().split("\n")
    )
    assert header.split()[3] == "NVIDIA_H200,NVIDIA_H100"
    assert "test_3.py::test_old" in ids and "test.py::test_b" in ids
