"""The profile's gap reading (launch/bench/trace_gaps.py): phases, idle stretches and what the host did
meanwhile, on a hand-made trace whose answers are known, and the host side of a real torch.profiler
trace (no device here: its device half is the hand-made one's)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from launch.bench.trace_gaps import Trace, Work, busy_within, gaps, phase_work, phases, report


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace() -> Trace:
    """forward_backward [0, 1000), optimizer [1000, 2000); the device: k1 [10, 400), k2 [600, 900)
    (launched at 550, inside aten::mm, after the device ran dry inside aten::item: 200 µs waiting for
    the host), k3 [1200, 1300) on stream 8 (launched at 850: 300 µs of queued work held back), k4
    [1350, 1500) (a 50 µs gap, under the threshold) overlapped by k5 [1320, 1400) on stream 8."""
    return Trace.from_events(
        [
            _x("user_annotation", "kiln.forward_backward", 0, 1000),
            _x("user_annotation", "kiln.optimizer", 1000, 1000),
            _x("cpu_op", "aten::item", 380, 120),
            _x("cuda_runtime", "cudaStreamSynchronize", 390, 100),
            _x("cpu_op", "aten::mm", 540, 20),
            _x("cuda_runtime", "cudaLaunchKernel", 5, 3, corr=1),
            _x("cuda_runtime", "cudaLaunchKernel", 550, 3, corr=2),
            _x("cuda_runtime", "cudaLaunchKernel", 850, 3, corr=3),
            _x("cuda_runtime", "cudaLaunchKernel", 1010, 3, corr=4),
            _x("cuda_runtime", "cudaLaunchKernel", 1015, 3, corr=5),
            _x("kernel", "k1", 10, 390, tid=7, corr=1),
            _x("kernel", "k2", 600, 300, tid=7, corr=2),
            _x("kernel", "k3", 1200, 100, tid=8, corr=3),
            _x("kernel", "k4", 1350, 150, tid=7, corr=4),
            _x("gpu_memcpy", "Memcpy DtoD", 1320, 80, tid=8, corr=5),
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
            {"ph": "X", "cat": "kernel", "name": "no time"},  # malformed: left out
        ]
    )


def test_phases_count_the_device_busy_inside_each():
    got = {p.name: (p.wall_us, p.busy_us, p.idle_us) for p in phases(_trace())}
    assert got == {"kiln.forward_backward": (1000, 690, 310), "kiln.optimizer": (1000, 280, 720)}


def test_a_gap_is_read_as_waiting_for_the_host_or_for_queued_work():
    found = gaps(_trace(), min_gap_us=100)
    assert [(g.start, g.end) for g in found] == [(400, 600), (900, 1200)]  # the 20 µs one is under the threshold
    host, queued = found
    assert host.host_bound and host.launched_us == 150 and host.phase == "kiln.forward_backward"
    assert host.dry == ("kiln.forward_backward", "aten::item") and host.launcher == (
        "kiln.forward_backward",
        "aten::mm",
    )
    assert host.next_work == "k2"
    assert not queued.host_bound and queued.launched_us == -50 and queued.next_work == "k3"
    assert [g.us for g in gaps(_trace(), min_gap_us=10)] == [200, 300, 20]


def test_device_work_counts_in_the_phase_that_launched_it():
    """k3 runs during the optimizer but was launched in forward_backward: it counts there."""
    got = phase_work(_trace())
    assert got == {
        "kiln.forward_backward": [Work("k1", 1, 390), Work("k2", 1, 300), Work("k3", 1, 100)],
        "kiln.optimizer": [Work("k4", 1, 150), Work("Memcpy DtoD", 1, 80)],
    }
    text = report(_trace(), per_phase=2)
    assert "| kiln.forward_backward | `k1` | 1 | 0.39 |" in text and "| kiln.optimizer | `k4` | 1 | 0.15 |" in text
    assert "`k3`" not in text.split("device gaps")[0]  # only each phase's top 2 listed


def test_busy_time_merges_streams_and_clips_to_the_window():
    busy = _trace().busy()
    assert busy == [(10, 400), (600, 900), (1200, 1300), (1320, 1500)]
    assert busy_within(busy, 350, 650) == 100 and busy_within(busy, 0, 5000) == 970


def test_the_report_tables_the_phases_and_the_longest_gaps_first():
    text = report(_trace(), min_gap_us=100)
    assert "| kiln.forward_backward | 1.00 | 0.69 | 0.31 |" in text
    assert "2 device gaps of ≥ 100 µs, 0.50 ms in all; 0.20 ms of them waiting for the host" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert "queued work" in rows[0] and "`k3`" in rows[0]
    assert "the host" in rows[1] and "`aten::item`" in rows[1] and "`aten::mm`" in rows[1]


def test_a_real_profiler_trace_gives_its_phases(tmp_path):
    model = torch.nn.Linear(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("kiln.forward_backward"):
            model(torch.randn(4, 32)).sum().backward()
        with record_function("kiln.optimizer"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = Trace.read(path)
    got = phases(trace)
    assert [p.name for p in got] == ["kiln.forward_backward", "kiln.optimizer"]
    assert all(p.wall_us > 0 and p.busy_us == 0 for p in got)  # no device on this machine
    assert any(s.name.startswith("aten::") for s in trace.host[trace.main_thread()])
    assert gaps(trace) == [] and "0 device gaps" in report(trace)
