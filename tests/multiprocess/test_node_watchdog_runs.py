"""The node watchdog waits for a late node, up to ``comm.init_timeout_seconds``.

With a lazily connecting process group (NCCL; gloo with
``TORCH_GLOO_LAZY_INIT=1``, used here) ``init_process_group`` returns on each
node without waiting for the others, so the nodes' watchdogs start as far
apart as their ranks reach it. Two two-node CP2 jobs (``run_train.sh``,
NNODES=2 on loopback) run at once, node 1's ranks delayed before they build
the trainer (``tests/faults.py`` ``late_node``): by ``LATE_S``, past the
watchdog's 30 s of silence, in one; for good, in the other.
"""

import contextlib
import os
import re
import signal
import threading
import types
from datetime import datetime
from pathlib import Path

from torchtitan_ext.tools.parity import RunRecord

from ..faults import DELAY_ENV, FAULT_ENV, NODE_ENV
from ..parity_suites import FP32
from .test_resume import _pids, _start_two_nodes

LATE_S = 45
# The job whose node 1 never starts waits this long for it (default 300 s).
INIT_TIMEOUT_S = 60
NEVER_S = 3600  # node 1 is killed once node 0 has ended
STARTED = "Node watchdog on node {} of 2 started"
NEVER_BEATEN = (
    "Node watchdog on node 0: node 1 of 2 has not beaten in torchrun's store at "
    "{}:{} (on node 0) since this node's watchdog started"
)

_Job = tuple[Path, list[threading.Thread], dict[int, RunRecord]]


def _start(out: Path, name: str, delay_s: int, args: list[str]) -> _Job:
    env = {
        "TORCH_GLOO_LAZY_INIT": "1",
        "TRAIN_FILE": "tests.faults",
        FAULT_ENV: "late_node",
        NODE_ENV: "1",
        DELAY_ENV: str(delay_s),
    }
    dump = out / name
    runs = types.SimpleNamespace(out=out)  # all _start_two_nodes reads of it
    nodes, records = _start_two_nodes(runs, dump, [FP32, *args], env)
    return dump, nodes, records


def _join(job: _Job, *, end_node1: bool) -> dict[int, str]:
    """Both nodes' logs, once node 0 has ended; node 1 killed if it failed."""
    dump, nodes, records = job
    nodes[0].join()
    if end_node1 or not records[0].ok:  # node 1 would wait for node 0's store
        for pid in _pids(dump, "NODE_RANK=1"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    nodes[1].join()
    return {node: Path(record.log_path).read_text() for node, record in records.items()}


def _logged_at(log: str, text: str) -> datetime:
    """When the first line of ``log`` holding ``text`` was logged."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = re.search(r"\[titan\] (\S+ \S+) - ", line)[1]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")


def _watchdog_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "Node watchdog on node" in line]


def test_a_late_node_trains_and_one_that_never_starts_is_named_at_the_init_timeout(
    tmp_path,
):
    """Node 1 late by LATE_S: both nodes train to the end. Node 1 never
    starting: node 0's watchdog names it ``INIT_TIMEOUT_S`` after it started,
    not before, and before the process group's first collective (which waits
    as long, from later) fails without naming it.
    """
    late = _start(tmp_path, "late_node", LATE_S, ["--training.steps=2"])
    never_args = ["--training.steps=2", f"--comm.init_timeout_seconds={INIT_TIMEOUT_S}"]
    never = _start(tmp_path, "never_node", NEVER_S, never_args)
    late_logs = _join(late, end_node1=False)
    never_log = _join(never, end_node1=True)[0]
    late_records, never_record = late[2], never[2][0]
    print(
        f"late node 1: exit codes {[r.returncode for r in late_records.values()]}, "
        f"watchdog {_watchdog_lines(late_logs[0])}; node 1 never started: exit "
        f"code {never_record.returncode}, watchdog {_watchdog_lines(never_log)}"
    )

    assert all(record.ok for record in late_records.values()), late_records
    for log in late_logs.values():
        assert re.search(r"step:\s+2\b", log), "a node did not train to the end"
    # The watchdogs started further apart than a beating node may be silent.
    stale_s = re.search(r"a node silent for (\d+) s", late_logs[0])[1]
    started = [_logged_at(late_logs[node], STARTED.format(node)) for node in (0, 1)]
    assert (started[1] - started[0]).total_seconds() > float(stale_s), started

    assert never_record.returncode != 0 and not never_record.timed_out, never_record
    endpoint = never_record.job_env["RDZV_ENDPOINT"].split(":")
    named = NEVER_BEATEN.format(*endpoint)
    assert named in never_log, _watchdog_lines(never_log)
    # torchtitan's seed broadcast, just after the watchdog started, waits
    # INIT_TIMEOUT_S too: a gloo lazy connect that timed out says DistStoreError.
    assert "DistStoreError" not in never_log
    named_after = _logged_at(never_log, named) - _logged_at(
        never_log, STARTED.format(0)
    )
    print(f"node 1, never started, named {named_after.total_seconds():.2f} s on")
    assert named_after.total_seconds() >= INIT_TIMEOUT_S
