"""Run a function on N gloo processes on this machine, with a hard timeout.

The tests' and benchmarks' one launcher. Each spawned rank switches torchtitan to
the CPU backend, sets torchrun's environment, joins one gloo group on 127.0.0.1
(unless ``init_process_group=False``: a Trainer built in ``fn`` joins its own)
and calls ``fn``, a picklable top-level function, unpickled after
``cpu_backend.apply()`` (so a test module may import torchtitan at its top).
Results come back through ``torch.save``, so tensors are fine.
"""

import io
import math
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankError", "free_port", "run_on_ranks"]

_POLL_S = 0.2
_GRACE_S = 2.0  # after a first failure, how long to wait for the other ranks'


class RankError(RuntimeError):
    """A rank raised, or died without reporting."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, payload, timeout_s, init_process_group, send):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ[name] = os.environ[f"LOCAL_{name}"] = str(value)
    try:
        from torchtitan_ext import cpu_backend

        cpu_backend.apply()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if init_process_group:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        send.send((True, buffer.getvalue()))
    except BaseException:
        send.send((False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]``, on gloo ranks.

    ``RankError`` carries the failing ranks' tracebacks or exit codes;
    ``TimeoutError`` names the ranks still running after ``timeout_s`` (a hang?).
    All processes are killed at the end: no rank pays its interpreter teardown.
    """
    context = multiprocessing.get_context("spawn")
    payload = pickle.dumps((fn, args, kwargs))
    common = (world_size, free_port(), payload, timeout_s, init_process_group)
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    processes = [
        context.Process(target=_entry, args=(rank, *common, send), daemon=True)
        for rank, (_, send) in enumerate(pipes)
    ]
    pending = {receive: rank for rank, (receive, _) in enumerate(pipes)}
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline, report_at = time.monotonic() + timeout_s, math.inf
    try:
        for process, (_, send) in zip(processes, pipes, strict=True):
            process.start()
            send.close()  # the rank holds the only copy: EOF once it ends
        while pending:
            now = time.monotonic()
            if now > report_at:
                break
            if now > deadline:
                running = [r for r in range(world_size) if r not in outputs]
                raise TimeoutError(
                    f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks: "
                    f"rank(s) {running} still running after {timeout_s:.0f} s "
                    "(hang?); all processes killed"
                )
            for receive in wait(list(pending), timeout=_POLL_S):
                rank = pending.pop(receive)
                try:
                    ok, data = receive.recv()
                except EOFError:  # ended without reporting
                    processes[rank].join(timeout=_GRACE_S)
                    code = processes[rank].exitcode
                    ok, data = False, f"exited with code {code} without a result"
                if ok:
                    outputs[rank] = torch.load(io.BytesIO(data), weights_only=False)
                else:
                    failures[rank] = data
                    report_at = min(report_at, now + _GRACE_S)
        if failures:
            lines = [
                f"rank {r} of {world_size}: {failures[r]}" for r in sorted(failures)
            ]
            raise RankError("\n".join(lines))
    finally:
        started = [process for process in processes if process.pid is not None]
        for process in started:
            process.kill()
        for process in started:
            process.join(timeout=10)
        for receive, _ in pipes:
            receive.close()
    return [outputs[rank] for rank in range(world_size)]
