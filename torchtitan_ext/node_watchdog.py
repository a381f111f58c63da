"""A dead node ends the job on every node within a minute, not at a timeout.

torchrun's static rendezvous (``run_train.sh``'s, for ranks placed by
NODE_RANK) watches no other node, and neither does c10d's once training has
started: its agents heartbeat, but act only on nodes that join, and it orders
ranks by host and pid instead of NODE_RANK. A node that dies without closing
its sockets (power, kernel, network) leaves every other node blocked in its
next collective until the process group's timeout (torchtitan's
``comm.train_timeout_seconds``, 100 s; 300 s before step 1). Measured on two
loopback nodes: README, "Checkpoints, restarts and failures".

Local rank 0 of each node bumps its counter in torchrun's store every
``interval_s`` and reads the other nodes'. A node whose counter has not moved
for ``stale_s`` since it last did (clock-free: only this node's monotonic
clock is read), or a store that stops answering for as long (node 0 hosts it),
ends this node's ranks with one line naming it: torchrun then stops the node's
other ranks. A node that finished training says so, so it is never taken for
dead.

A node that has not beaten yet is judged only ``init_timeout_s``
(``comm.init_timeout_seconds``) after this node's watchdog started: nodes
start their watchdogs apart when the process group connects lazily (NCCL;
gloo with ``TORCH_GLOO_LAZY_INIT=1``) and one node's ranks import slowly,
and the process group's first collective waits as long for them. Keys live
under torchrun's run id, and each watchdog counts a beat or a finished mark
only past the counters it first read: a restart (``--max-restarts``) keeps the
rendezvous' store, and must not take the previous attempt's marks for its own,
while nodes whose agents count their restarts apart (c10d restarts a healthy
node's workers without counting) still see each other.
"""

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger

__all__ = ["NodeWatchdog"]

_PREFIX = "torchtitan_ext/node_watchdog/{run}"
_KEY = "{}/{}"  # kind, node
_INSTEAD = "rather than at the collectives' timeout (comm.train_timeout_seconds)"


def _end_this_node(message: str) -> None:
    """Log and exit at once: the main thread may be blocked in a collective."""
    logger.error(message)
    os._exit(1)


class NodeWatchdog:
    """Heartbeats of every node through one store; a stale one ends this node."""

    def __init__(
        self,
        store: dist.Store,
        node: int,
        nodes: int,
        *,
        init_timeout_s: float,
        interval_s: float = 5.0,
        stale_s: float = 30.0,
        where: str = "torchrun's store",
        on_dead: Callable[[str], None] = _end_this_node,
    ) -> None:
        self._store, self._node, self._nodes = store, node, nodes
        self._init_timeout_s = init_timeout_s
        self._interval_s, self._stale_s = interval_s, stale_s
        self._where, self._on_dead = where, on_dead
        # When this node began waiting, the store's last answer: set by start().
        self._started = self._answered = time.monotonic()
        self._moved: dict[int, float] = {}  # a beaten node's last beat, seen here
        self._beats: dict[int, int] = {}
        # Each node's counters as this attempt's first read found them: what
        # an earlier attempt of the run left there is neither a beat nor done.
        self._baseline: dict[str, dict[int, int]] | None = None
        self._finished: set[int] = set()
        self._error = ""  # why the store stopped answering, when it said
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=loop, daemon=True, name=f"node-watchdog{loop.__name__}"
            )
            for loop in (self._beat, self._watch)
        ]

    @classmethod
    def for_torchrun(
        cls, init_timeout_s: float, **options: Any
    ) -> "NodeWatchdog | None":
        """Local rank 0's watchdog of a multi-node torchrun job; None otherwise.

        ``options``: the constructor's clocks and ``on_dead``.
        """
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes == 1 or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=30)
        )
        prefix = _PREFIX.format(run=os.environ.get("TORCHELASTIC_RUN_ID", "none"))
        return cls(
            dist.PrefixStore(prefix, store),
            int(os.environ["GROUP_RANK"]),
            nodes,
            init_timeout_s=init_timeout_s,
            where=f"torchrun's store at {host}:{port} (on node 0)",
            **options,
        )

    def start(self) -> "NodeWatchdog":
        logger.info(
            f"Node watchdog on node {self._node} of {self._nodes} started: a node "
            f"silent for {self._stale_s:.0f} s ends this node, one that has not "
            f"beaten yet after {self._init_timeout_s:.0f} s "
            "(comm.init_timeout_seconds)."
        )
        # After the line: its time is never later than the clocks' start.
        self._started = self._answered = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def finished(self) -> None:
        """This node trained to the end: the others must not wait for its beats."""
        self.stop()
        try:
            self._store.add(_KEY.format("finished", self._node), 1)
        except RuntimeError as e:  # the job's work is done: say so, do not fail it
            logger.warning(f"Node watchdog could not mark node {self._node} done: {e}")

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        # A frozen store blocks ``add`` past its timeout, a dead one raises:
        # either way ``_answered`` stops and ``_watch`` notices.
        while not self._stop.is_set():
            try:
                if self._baseline is None:
                    self._baseline = {
                        kind: {n: self._count(kind, n) for n in range(self._nodes)}
                        for kind in ("beat", "finished")
                    }
                self._store.add(_KEY.format("beat", self._node), 1)
                for node in range(self._nodes):
                    beats = self._count("beat", node)
                    if beats > self._baseline["beat"][
                        node
                    ] and beats != self._beats.get(node):
                        self._beats[node], self._moved[node] = beats, time.monotonic()
                    if self._count("finished", node) > self._baseline["finished"][node]:
                        self._finished.add(node)
            except RuntimeError as e:  # the DistError family, or a reset socket
                self._error = f" ({type(e).__name__}: {e})"
                return
            self._answered = time.monotonic()
            self._stop.wait(self._interval_s)

    def _count(self, kind: str, node: int) -> int:
        return self._store.add(_KEY.format(kind, node), 0)

    def _watch(self) -> None:
        while not self._stop.wait(self._next_watch_s()):
            now = time.monotonic()
            silent = [
                node
                for node in range(self._nodes)
                if node not in self._finished and self._overdue_s(node, now) >= 0
            ]
            store_silent_s = now - self._answered
            if store_silent_s > 2 * self._interval_s and (
                silent or store_silent_s > self._stale_s
            ):
                return self._dead(
                    f"{self._where} has not answered for {store_silent_s:.0f} s"
                    f"{self._error} (dead, frozen or cut off)"
                )
            if silent and silent[0] not in self._moved:
                return self._dead(
                    f"node {silent[0]} of {self._nodes} has not beaten in "
                    f"{self._where} since this node's watchdog started "
                    f"{now - self._started:.0f} s ago (comm.init_timeout_seconds "
                    f"is {self._init_timeout_s:g}; never started, dead or cut off)",
                    "before the process group's first collective times out "
                    "without naming it",
                )
            if silent:
                return self._dead(
                    f"node {silent[0]} of {self._nodes} has not beaten in "
                    f"{self._where} for {now - self._moved[silent[0]]:.0f} s "
                    "(dead, frozen or cut off)"
                )

    def _overdue_s(self, node: int, now: float) -> float:
        """Seconds ``node`` is past its deadline (>= 0: dead); < 0: short of it."""
        if node in self._moved:
            return now - self._moved[node] - self._stale_s
        return now - self._started - self._init_timeout_s

    def _next_watch_s(self) -> float:
        """The interval, or less to judge a node that has not beaten on time.

        The process group's first collective waits as long from a moment after
        this watchdog started: judged on time, the node is named here before
        that collective fails without naming it.
        """
        to_deadline_s = self._started + self._init_timeout_s - time.monotonic()
        if len(self._moved) < self._nodes and to_deadline_s > 0:
            return min(self._interval_s, to_deadline_s)
        return self._interval_s

    def _dead(self, why: str, instead: str = _INSTEAD) -> None:
        self._on_dead(
            f"Node watchdog on node {self._node}: {why}; ending this node's "
            f"ranks now {instead}."
        )
