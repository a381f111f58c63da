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
for ``stale_s`` (clock-free: only this node's monotonic clock is read), or a
store that stops answering for as long (node 0 hosts it), ends this node's
ranks with one line naming it: torchrun then stops the node's other ranks.
A node that finished training says so, so it is never taken for dead.
"""

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torchtitan.tools.logging import logger

__all__ = ["NodeWatchdog"]

_KEY = "torchtitan_ext/node_watchdog/{}/{}"


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
        interval_s: float = 5.0,
        stale_s: float = 30.0,
        where: str = "torchrun's store",
        on_dead: Callable[[str], None] = _end_this_node,
    ) -> None:
        self._store, self._node, self._nodes = store, node, nodes
        self._interval_s, self._stale_s = interval_s, stale_s
        self._where, self._on_dead = where, on_dead
        now = time.monotonic()
        self._answered = now  # the store's last answer
        self._moved = dict.fromkeys(range(nodes), now)  # each node's last beat
        self._beats: dict[int, int] = {}
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
    def for_torchrun(cls) -> "NodeWatchdog | None":
        """Local rank 0's watchdog of a multi-node torchrun job; None otherwise."""
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes == 1 or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=30)
        )
        return cls(
            store,
            int(os.environ["GROUP_RANK"]),
            nodes,
            where=f"torchrun's store at {host}:{port} (on node 0)",
        )

    def start(self) -> "NodeWatchdog":
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
                self._store.add(_KEY.format("beat", self._node), 1)
                for node in range(self._nodes):
                    beats = self._store.add(_KEY.format("beat", node), 0)
                    if beats != self._beats.get(node):
                        self._beats[node], self._moved[node] = beats, time.monotonic()
                    if self._store.add(_KEY.format("finished", node), 0):
                        self._finished.add(node)
            except RuntimeError as e:  # the DistError family, or a reset socket
                self._error = f" ({type(e).__name__}: {e})"
                return
            self._answered = time.monotonic()
            self._stop.wait(self._interval_s)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            now = time.monotonic()
            silent = [
                node
                for node, moved in self._moved.items()
                if node not in self._finished and now - moved > self._stale_s
            ]
            store_silent_s = now - self._answered
            if store_silent_s > 2 * self._interval_s and (
                silent or store_silent_s > self._stale_s
            ):
                return self._dead(
                    f"{self._where} has not answered for {store_silent_s:.0f} s"
                    + self._error
                )
            if silent:
                return self._dead(
                    f"node {silent[0]} of {self._nodes} has not beaten in "
                    f"{self._where} for {now - self._moved[silent[0]]:.0f} s"
                )

    def _dead(self, why: str) -> None:
        self._on_dead(
            f"Node watchdog on node {self._node}: {why} (dead, frozen or cut off); "
            "ending this node's ranks now rather than at the collectives' timeout "
            "(comm.train_timeout_seconds)."
        )
