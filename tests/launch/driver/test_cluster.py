"""The session's Ray cluster (launch/driver/cluster.py): Ray's prefix on the actors' log lines is
coloured only where stderr is a terminal, so a run's log file carries no escape codes."""

from __future__ import annotations

import io
import os

import ray

from configs import ClusterConfig
from launch.driver.cluster import start_ray


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _fake_ray(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")  # recorded, so what start_ray sets is undone after the test
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    return calls


def test_a_log_file_gets_ray_lines_without_colour_codes(monkeypatch):
    calls = _fake_ray(monkeypatch)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # stderr redirected to a file
    assert start_ray(ClusterConfig(num_cpus=2)) is True
    assert os.environ["RAY_COLOR_PREFIX"] == "0" and calls[0]["log_to_driver"]


def test_a_terminal_keeps_the_colours_and_the_users_setting_wins(monkeypatch):
    _fake_ray(monkeypatch)
    monkeypatch.setattr("sys.stderr", _Terminal())
    start_ray(ClusterConfig(num_cpus=2))
    assert "RAY_COLOR_PREFIX" not in os.environ
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    monkeypatch.setattr("sys.stderr", io.StringIO())
    start_ray(ClusterConfig(num_cpus=2))
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_a_running_ray_is_joined_not_started(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(AssertionError("ray.init called")))
    assert start_ray(ClusterConfig()) is False
