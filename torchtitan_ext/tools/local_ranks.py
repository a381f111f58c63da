"""Run a function on N gloo processes on this machine, with a hard timeout.

The one launcher of the tests and the benchmarks. ``run_on_ranks(fn,
world_size, *args)`` starts ``world_size`` fresh (spawned) processes, each of
which switches torchtitan to the CPU backend, sets torchrun's environment
(``MASTER_ADDR``, ``RANK``, ...), joins one gloo process group on 127.0.0.1
(unless ``init_process_group=False``: a Trainer built in ``fn`` joins its own)
and calls ``fn(*args, **kwargs)``. It returns every rank's result (rank order),
or raises with the failing rank's traceback. If any rank has not finished when
the timeout expires (a hang in a collective, say), every process is killed and
``TimeoutError`` names the ranks still running. A rank's interpreter teardown
never runs: once every result is in, the processes are killed.

``fn`` and its arguments must be picklable (a top-level function of a module);
results travel back through ``torch.save``, so tensors are fine. They are
unpickled in the child only after ``cpu_backend.apply()``, so a test module may
import torchtitan at its top.
"""

import io
import math
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

__all__ = ["RankError", "free_port", "run_on_ranks"]

_POLL_S = 0.2
_GRACE_S = 2.0


class RankError(RuntimeError):
    """A rank raised, or died without reporting."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    payload: bytes,
    timeout_s: float,
    init_process_group: bool,
    results: multiprocessing.Queue,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        from torchtitan_ext import cpu_backend

        cpu_backend.apply()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        import torch.distributed as dist

        if init_process_group:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _kill(processes: list) -> None:
    # Results are in: no need to wait for interpreter shutdown (seconds each).
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.kill()
    for process in started:
        process.join(timeout=10)


def _dead_ranks(processes: list, reported: set[int]) -> set[int]:
    """Ranks that ended without reporting (nothing of them left in the queue
    once seen dead on two polls in a row)."""
    return {
        rank
        for rank, process in enumerate(processes)
        if rank not in reported and not process.is_alive()
    }


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]``, on gloo ranks."""
    payload = pickle.dumps((fn, args, kwargs))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_entry,
            args=(rank, world_size, port, payload, timeout_s, init_process_group),
            kwargs={"results": results},
            daemon=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exited: set[int] = set()
    report_at = math.inf  # after a first failure, wait a little for the others
    try:
        for process in processes:
            process.start()
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > report_at:
                break
            if now > deadline:
                pending = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(
                    f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks: "
                    f"rank(s) {pending} still running after {timeout_s:.0f} s "
                    "(hang?); all processes killed"
                )
            try:
                rank, ok, data = results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = _dead_ranks(processes, {*outputs, *failures})
                for rank in dead & exited:  # dead on two polls in a row
                    code = processes[rank].exitcode
                    failures[rank] = f"exited with code {code} without a result"
                    report_at = min(report_at, now + _GRACE_S)
                exited = dead
                continue
            if ok:
                outputs[rank] = torch.load(io.BytesIO(data), weights_only=False)
            else:
                failures[rank] = data
                report_at = min(report_at, now + _GRACE_S)
        if failures:
            raise RankError(
                "\n".join(
                    f"rank {rank} of {world_size}: {failures[rank]}"
                    for rank in sorted(failures)
                )
            )
    finally:
        _kill(processes)
        results.close()
    return [outputs[rank] for rank in range(world_size)]
