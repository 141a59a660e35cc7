"""The run's address registry and the reconnecting client: actors register, peers look addresses up,
writers in several processes never lose each other's entries, readers never see a torn file, and a
client follows its server to a new address after a restart."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

import protocols as P
from protocols.channels import NoServer, ReconnectingClient, RemoteError, ReplyServer
from protocols.registry import REGISTRY_FILE, NotRegistered, Registry

CTX = mp.get_context("spawn")


def _register_many(run_dir: str, worker: int, n: int) -> None:
    registry = Registry(run_dir)
    for i in range(n):
        registry.register(f"w{worker}-{i}", "verifier", {"verifier": f"tcp://10.0.0.{worker}:{1000 + i}"})


def test_entries_replace_lookups_and_pools(tmp_path):
    registry = Registry(tmp_path)
    assert registry.entries() == {} and registry.address("replay", "replay") == ""
    registry.register("replay", "replay", {"replay": "tcp://a:1"})
    registry.register("verifier-1", "verifier", {"verifier": "tcp://v:2"})
    registry.register("verifier-0", "verifier", {"verifier": "tcp://v:1"})
    assert registry.address("replay", "replay") == "tcp://a:1"
    assert registry.pool("verifier", "verifier") == "tcp://v:1,tcp://v:2"  # name order
    resolve = registry.resolver("replay", "replay")
    registry.register("replay", "replay", {"replay": "tcp://a:2"})  # a restarted replay re-registers
    assert resolve() == "tcp://a:2"
    registry.unregister("verifier-0")
    assert registry.pool("verifier", "verifier") == "tcp://v:2"
    entry = registry.entries()["replay"]
    assert entry.role == "replay" and entry.pid > 0 and entry.time > 0
    registry.clear()
    assert registry.entries() == {}


def test_a_garbled_registry_reads_as_empty_and_wait_gives_up(tmp_path):
    (tmp_path / REGISTRY_FILE).write_text("{not json")
    registry = Registry(tmp_path)
    assert registry.entries() == {}
    with pytest.raises(NotRegistered, match="learner registered no 'ranks' endpoint"):
        registry.wait("learner", "ranks", timeout_s=0.2)
    threading.Timer(0.2, lambda: registry.register("learner", "learner", {"ranks": "h:1"})).start()
    assert registry.wait("learner", "ranks", timeout_s=10) == "h:1"


def test_writers_in_several_processes_lose_no_entry(tmp_path):
    procs = [CTX.Process(target=_register_many, args=(str(tmp_path), w, 25)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = Registry(tmp_path).entries()
    assert len(entries) == 75 and entries["w2-24"].endpoints == {"verifier": "tcp://10.0.0.2:1024"}


class _Served:
    """A ReplyServer on its own thread that answers every request with a TaskReply naming `tag`."""

    def __init__(self, tag: str) -> None:
        self.server, self.stop = ReplyServer(), threading.Event()
        reply = lambda rec: P.TaskReply(status="stop", group_id=tag)
        self.thread = threading.Thread(target=self.server.serve, args=(reply, self.stop), daemon=True)
        self.thread.start()
        self.address = self.server.address

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.server.close()


def _serve_registered(registry: Registry, tag: str) -> _Served:
    served = _Served(tag)
    registry.register("replay", "replay", {"replay": served.address})
    return served


def test_the_reconnecting_client_follows_a_restarted_server(tmp_path):
    registry = Registry(tmp_path)
    client = ReconnectingClient(registry.resolver("replay", "replay"), timeout_s=0.3, retries=0, recheck_s=60)
    with pytest.raises(NoServer):  # nothing registered yet: a timeout to the caller
        client.request(P.TaskRequest(actor_id="r"))
    first = _serve_registered(registry, "first")
    assert client.request(P.TaskRequest(actor_id="r")).group_id == "first"
    first.close()
    second = _serve_registered(registry, "second")
    assert client.moved()
    # The request goes to the dead address first (no lookup for 60 s): the wait sees the new address
    # within `watch_s` and the same request goes to the new server, long before the timeout.
    started = time.monotonic()
    assert client.request(P.TaskRequest(actor_id="r"), timeout_s=30.0).group_id == "second"
    assert time.monotonic() - started < 5.0
    assert client.connects == 2 and not client.moved()
    client.close()
    second.close()


def test_a_request_made_while_its_server_is_down_goes_to_the_replacement_at_once(tmp_path):
    # The server dies with its address still registered (the supervisor has not noticed yet): the
    # client has no connection to send on. Its request must reach the replacement as soon as that
    # registers, not wait out the timeout (30 s for the learner's batch requests) on the dead address.
    registry = Registry(tmp_path)
    client = ReconnectingClient(registry.resolver("replay", "replay"), timeout_s=30.0, retries=1)
    first = _serve_registered(registry, "first")
    assert client.request(P.TaskRequest(actor_id="r")).group_id == "first"
    first.close()
    time.sleep(0.3)  # the client's connection to the dead server is gone
    second = _Served("second")
    threading.Timer(1.0, lambda: registry.register("replay", "replay", {"replay": second.address})).start()
    started = time.monotonic()
    assert client.request(P.TaskRequest(actor_id="r")).group_id == "second"
    assert time.monotonic() - started < 3.0
    client.close()
    second.close()


def test_a_remote_error_is_passed_on(tmp_path):
    server, stop = ReplyServer(), threading.Event()
    t = threading.Thread(target=server.serve, args=(lambda rec: 1 / 0, stop), daemon=True)
    t.start()
    client = ReconnectingClient(server.address, timeout_s=2.0)
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        client.request(P.TaskRequest(actor_id="r"))
    client.close()
    stop.set()
    t.join(5)
    server.close()
