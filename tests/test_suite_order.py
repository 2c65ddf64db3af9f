"""The suite's own order: modules longest first by the seconds the last full run recorded (tests/conftest.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

import conftest


def items(*names):
    return [SimpleNamespace(path=Path(f"tests/{name}.py"), name=f"{name}::{i}") for name in names for i in range(2)]


def order(monkeypatch, tmp_path, durations, names):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps(durations))
    monkeypatch.setattr(conftest, "DURATIONS", path)
    collected = items(*names)
    conftest.pytest_collection_modifyitems(None, collected)
    return [item.name for item in collected]


def test_modules_run_longest_first_by_their_recorded_seconds_families_together(monkeypatch, tmp_path):
    durations = {"test_a": 5.0, "test_b": 50.0, "test_serve": 20.0, "test_serve_faults": 20.0, "test_c": 30.0}
    got = order(monkeypatch, tmp_path, durations, ["test_a", "test_b", "test_c", "test_serve_faults", "test_serve"])
    # test_serve and test_serve_faults are one family of 40 s; each module's tests keep their order.
    assert got == ["test_b::0", "test_b::1", "test_serve::0", "test_serve::1", "test_serve_faults::0",
                   "test_serve_faults::1", "test_c::0", "test_c::1", "test_a::0", "test_a::1"]


def test_a_module_never_recorded_runs_first_and_an_unreadable_record_keeps_name_order(monkeypatch, tmp_path):
    got = order(monkeypatch, tmp_path, {"test_a": 5.0, "test_b": 50.0}, ["test_a", "test_b", "test_new"])
    assert got[:2] == ["test_new::0", "test_new::1"] and got[2:4] == ["test_b::0", "test_b::1"]
    path = tmp_path / "durations.json"
    path.write_text("not json")
    monkeypatch.setattr(conftest, "DURATIONS", path)
    collected = items("test_b", "test_a")
    conftest.pytest_collection_modifyitems(None, collected)
    assert [item.name for item in collected] == ["test_a::0", "test_a::1", "test_b::0", "test_b::1"]


def test_a_run_records_its_seconds_in_pytests_cache_and_the_tracked_file_only_when_asked(monkeypatch, tmp_path):
    tracked = tmp_path / "durations.json"
    tracked.write_text('{"test_a": 1.0}')
    monkeypatch.setattr(conftest, "DURATIONS", tracked)
    monkeypatch.setattr(conftest, "_seconds", {"test_a": 7.04, "test_b": 2.0})
    cache = {}

    def config(record):
        return SimpleNamespace(option=SimpleNamespace(markexpr="", keyword=""), args=[str(tmp_path / "tests")],
                               rootpath=tmp_path, cache=SimpleNamespace(get=cache.get, set=cache.__setitem__),
                               getoption=lambda name: record)

    assert conftest.recorded_durations(config(False)) == {"test_a": 1.0}  # a fresh clone: the tracked order
    conftest.pytest_sessionfinish(SimpleNamespace(config=config(False)), 0)
    assert tracked.read_text() == '{"test_a": 1.0}'  # a run leaves the tracked file as it was
    assert conftest.recorded_durations(config(False)) == {"test_a": 7.0, "test_b": 2.0}  # and orders the next
    conftest.pytest_sessionfinish(SimpleNamespace(config=config(True)), 0)
    assert json.loads(tracked.read_text()) == {"test_a": 7.0, "test_b": 2.0}
