"""The node watchdog's decisions, on one in-process store with short clocks.

The real thing, two torchrun nodes on loopback with one frozen, is
``test_a_dead_or_frozen_node_ends_the_job_on_the_other_node_within_a_minute``
in ``tests/multiprocess/test_resume.py``.
"""

import threading
import time

import torch.distributed as dist

from torchtitan_ext.node_watchdog import NodeWatchdog

INTERVAL_S = 0.05
STALE_S = 0.5


class _FreezableStore:
    """A store whose every call blocks while frozen, as a SIGSTOPped host's does."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.thawed = threading.Event()
        self.thawed.set()

    def add(self, key: str, value: int) -> int:
        self.thawed.wait()
        return self._store.add(key, value)


def _nodes(store, count: int = 2) -> tuple[list[NodeWatchdog], list[str]]:
    deaths: list[str] = []
    watchdogs = [
        NodeWatchdog(
            store,
            node,
            count,
            interval_s=INTERVAL_S,
            stale_s=STALE_S,
            on_dead=deaths.append,
        ).start()
        for node in range(count)
    ]
    return watchdogs, deaths


def _settle(watchdogs: list[NodeWatchdog]) -> None:
    time.sleep(4 * STALE_S)
    for watchdog in watchdogs:
        watchdog.stop()


def test_live_and_finished_nodes_raise_nothing():
    watchdogs, deaths = _nodes(_FreezableStore(), 3)
    time.sleep(2 * STALE_S)
    watchdogs[2].finished()  # trained to the end: never taken for dead
    _settle(watchdogs)
    assert deaths == []


def test_a_silent_node_is_named_by_the_others():
    watchdogs, deaths = _nodes(_FreezableStore(), 3)
    watchdogs[1].stop()  # no beats, as a frozen or dead node
    _settle(watchdogs)
    assert len(deaths) == 2, deaths
    assert all("node 1 of 3 has not beaten in" in death for death in deaths), deaths
    assert {death.split(":")[0] for death in deaths} == {
        "Node watchdog on node 0",
        "Node watchdog on node 2",
    }


def test_a_frozen_store_is_named():
    store = _FreezableStore()
    watchdogs, deaths = _nodes(store)
    time.sleep(2 * INTERVAL_S)
    store.thawed.clear()
    _settle(watchdogs)
    store.thawed.set()
    assert len(deaths) == 2, deaths
    assert all("torchrun's store has not answered" in death for death in deaths), deaths
