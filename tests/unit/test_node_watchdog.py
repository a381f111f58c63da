"""The node watchdog's decisions, on one in-process store with short clocks.

The real thing, two torchrun nodes on loopback, is
``test_a_dead_or_frozen_node_ends_the_job_on_the_other_node_within_a_minute``
in ``tests/multiprocess/test_resume.py`` (a frozen or killed node) and
``tests/multiprocess/test_node_watchdog_runs.py`` (a late node, one that
never starts).
"""

import re
import threading
import time

import pytest
import torch.distributed as dist

from torchtitan_ext.node_watchdog import NodeWatchdog

INTERVAL_S = 0.05
STALE_S = 0.5
# Longer than STALE_S, so that a node judged by the wrong clock shows.
INIT_TIMEOUT_S = 4 * STALE_S


class _FreezableStore:
    """A store whose every call blocks while frozen, as a SIGSTOPped host's does."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.thawed = threading.Event()
        self.thawed.set()

    def add(self, key: str, value: int) -> int:
        self.thawed.wait()
        return self._store.add(key, value)


def _watchdog(
    store, node: int, count: int, deaths: list[str], **clocks: float
) -> NodeWatchdog:
    clocks = {"interval_s": INTERVAL_S, "stale_s": STALE_S, **clocks}
    return NodeWatchdog(
        store,
        node,
        count,
        init_timeout_s=INIT_TIMEOUT_S,
        on_dead=deaths.append,
        **clocks,
    )


def _nodes(store, count: int = 2) -> tuple[list[NodeWatchdog], list[str]]:
    deaths: list[str] = []
    watchdogs = [_watchdog(store, node, count, deaths) for node in range(count)]
    for watchdog in watchdogs:
        watchdog.start()
    return watchdogs, deaths


def _settle(watchdogs: list[NodeWatchdog]) -> None:
    time.sleep(4 * STALE_S)
    for watchdog in watchdogs:
        watchdog.stop()


def _never_beaten_is_named(deaths: list[str], node: int, count: int) -> None:
    assert len(deaths) == 1, deaths
    assert re.search(
        rf"node {node} of {count} has not beaten in torchrun's store.* since this "
        rf"node's watchdog started \d+ s ago \(comm.init_timeout_seconds is "
        rf"{INIT_TIMEOUT_S:g};",
        deaths[0],
    ), deaths


def test_live_and_finished_nodes_raise_nothing():
    watchdogs, deaths = _nodes(_FreezableStore(), 3)
    time.sleep(2 * STALE_S)
    watchdogs[2].finished()  # trained to the end: never taken for dead
    _settle(watchdogs)
    assert deaths == []


def test_a_node_that_stops_beating_is_named_by_the_others():
    watchdogs, deaths = _nodes(_FreezableStore(), 3)
    time.sleep(2 * INTERVAL_S)
    watchdogs[1].stop()  # it has beaten; now silent, as a frozen or dead node
    _settle(watchdogs)  # ends before INIT_TIMEOUT_S: judged by STALE_S
    assert len(deaths) == 2, deaths
    beaten = "node 1 of 3 has not beaten in torchrun's store for"
    assert all(beaten in death for death in deaths), deaths
    assert {death.split(":")[0] for death in deaths} == {
        "Node watchdog on node 0",
        "Node watchdog on node 2",
    }


def test_a_late_node_is_waited_for_until_the_init_timeout():
    """Node 1 starts beating after STALE_S (within the init timeout): alive."""
    store = _FreezableStore()
    deaths: list[str] = []
    early = _watchdog(store, 0, 2, deaths).start()
    time.sleep(INIT_TIMEOUT_S - 2 * STALE_S)
    late = _watchdog(store, 1, 2, deaths).start()
    _settle([early, late])
    assert deaths == []


def test_a_node_that_never_beats_is_named_at_the_init_timeout_not_before():
    """At the deadline itself, not at the next look: the process group's
    first collective times out just after it, without naming the node."""
    deaths: list[str] = []
    interval_s = 0.75 * INIT_TIMEOUT_S  # the next look would be 50% late
    clocks = {"interval_s": interval_s, "stale_s": 2 * interval_s}
    started = time.monotonic()  # before the watchdog's start: never late
    watchdog = _watchdog(_FreezableStore(), 0, 2, deaths, **clocks).start()
    while not deaths and time.monotonic() - started < 2 * INIT_TIMEOUT_S:
        time.sleep(INTERVAL_S / 5)
    named_after_s = time.monotonic() - started
    watchdog.stop()
    _never_beaten_is_named(deaths, 1, 2)
    assert INIT_TIMEOUT_S <= named_after_s < INIT_TIMEOUT_S + interval_s / 2


def test_a_frozen_store_is_named():
    store = _FreezableStore()
    watchdogs, deaths = _nodes(store)
    time.sleep(2 * INTERVAL_S)
    store.thawed.clear()
    _settle(watchdogs)
    store.thawed.set()
    assert len(deaths) == 2, deaths
    assert all("torchrun's store has not answered" in death for death in deaths), deaths


@pytest.mark.parametrize(
    ("previous", "changed", "value"),
    [
        ("finished", "TORCHELASTIC_RESTART_COUNT", "1"),
        ("beat", "TORCHELASTIC_RESTART_COUNT", "1"),
        ("beat", "TORCHELASTIC_RUN_ID", "another_job"),
    ],
)
def test_a_watchdog_never_reads_a_previous_attempts_counters(
    monkeypatch, previous, changed, value
):
    """torchrun's restart reuses its store: node 1's marks from attempt 0
    (finished, or beats from a run that crashed) must not count in attempt 1,
    where it never starts. Read, they would keep node 1 alive (finished) or
    judge it by STALE_S (beaten) instead of naming it at the init timeout.
    """
    server = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torchrun_env = {
        "GROUP_WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    for name, setting in torchrun_env.items():
        monkeypatch.setenv(name, setting)
    deaths: list[str] = []
    clocks = dict(interval_s=INTERVAL_S, stale_s=STALE_S, on_dead=deaths.append)

    def watchdog(node: int) -> NodeWatchdog:
        monkeypatch.setenv("GROUP_RANK", str(node))
        return NodeWatchdog.for_torchrun(INIT_TIMEOUT_S, **clocks).start()

    before = [watchdog(0), watchdog(1)]
    time.sleep(2 * INTERVAL_S)
    if previous == "finished":
        before[1].finished()
    for node in before:
        node.stop()
    assert deaths == []

    monkeypatch.setenv(changed, value)  # the next attempt, or another run
    after = watchdog(0)  # node 1 of this attempt never starts
    time.sleep(INIT_TIMEOUT_S + 4 * INTERVAL_S)
    after.stop()
    _never_beaten_is_named(deaths, 1, 2)


def test_nodes_whose_agents_count_restarts_apart_see_each_other(monkeypatch):
    """c10d's agent restarts a healthy node's workers without counting it (a
    membership change), the failed node's agent counts: one attempt, two
    restart counts. Namespaced by the count, each would name the other."""
    server = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    for name, setting in {
        "GROUP_WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": "job",
    }.items():
        monkeypatch.setenv(name, setting)
    deaths: list[str] = []
    watchdogs = []
    for node, restarts in ((0, "0"), (1, "1")):
        monkeypatch.setenv("GROUP_RANK", str(node))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        watchdogs.append(
            NodeWatchdog.for_torchrun(
                INIT_TIMEOUT_S,
                interval_s=INTERVAL_S,
                stale_s=STALE_S,
                on_dead=deaths.append,
            ).start()
        )
    time.sleep(INIT_TIMEOUT_S + 4 * INTERVAL_S)
    for watchdog in watchdogs:
        watchdog.stop()
    assert deaths == []
