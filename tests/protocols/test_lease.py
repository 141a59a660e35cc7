"""The device lease's trace (KILN_LEASE_TRACE) and the report read from it (launch/bench/lease_report.py):
a timed window that waits for a long shared hold to drain, and a shared holder that waits behind it,
each measured where it happened."""

from __future__ import annotations

import threading
import time

import pytest

from launch.bench import lease_report
from protocols.lease import TRACE_ENV, DeviceLease


def long_shared_hold(lease: DeviceLease, started: threading.Event) -> None:
    with lease.shared():
        started.set()
        time.sleep(0.4)


def timed_window(lease: DeviceLease) -> None:
    with lease.exclusive():
        time.sleep(0.1)


def late_shared_hold(lease: DeviceLease) -> None:
    with lease.shared():
        pass


def test_a_drain_and_the_wait_behind_it_are_traced_where_they_happened(tmp_path, monkeypatch):
    # Mutation: drop the turnstile time from exclusive()'s record -> no drain is reported; trace
    # holders by the lease's own frames -> the holders below are not named.
    trace = tmp_path / "lease.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    lease = DeviceLease("cpu", lock_dir=str(tmp_path))
    started = threading.Event()
    first = threading.Thread(target=long_shared_hold, args=(lease, started))
    first.start()
    started.wait(5)
    window = threading.Thread(target=timed_window, args=(lease,))
    window.start()
    time.sleep(0.1)  # the window has the turnstile and waits for the first hold to drain
    late = threading.Thread(target=late_shared_hold, args=(lease,))
    late.start()
    for t in (first, window, late):
        t.join(10)

    holds = lease_report.read(str(trace))
    assert sorted(h.kind for h in holds) == ["exclusive", "shared", "shared"]
    report = lease_report.analyse(holds)
    (name,) = [k for k in report.exclusive if ".timed_window:" in k]
    count, held, drain = report.exclusive[name]
    assert count == 1 and held == pytest.approx(0.1, abs=0.08) and drain == pytest.approx(0.3, abs=0.12)
    (long_name,) = [k for k in report.in_drains if ".long_shared_hold:" in k]
    assert report.in_drains[long_name] == pytest.approx(drain, abs=0.02)  # what the drain waited for
    (late_name,) = [k for k in report.shared if ".late_shared_hold:" in k]
    assert report.shared[late_name][3] == pytest.approx(0.3, abs=0.15)  # it waited behind the window
    assert report.leased_s == pytest.approx(0.5, abs=0.15)
    assert "timed_window" in lease_report.render(report, 5)


def test_no_trace_without_the_variable_and_a_missing_file_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    lease = DeviceLease("cpu", lock_dir=str(tmp_path))
    with lease.shared():
        pass
    with lease.exclusive():
        pass
    assert all(p.name.startswith("kiln-device-") for p in tmp_path.iterdir()) and lease.exclusive_s > 0  # no trace
    assert lease_report.main([str(tmp_path / "absent.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err
