"""The tests' and benchmarks' one launcher: a function on N gloo processes here.

On ``torch.multiprocessing``, with a hard timeout. Ranks fork from one server that
imported torchtitan on the CPU backend once (``warm_ranks``); each takes the
caller's environment and torchrun's, joins one gloo group on 127.0.0.1 (unless
``init_process_group=False``: a Trainer built in ``fn`` joins its own) and calls
``fn``, a picklable top-level function; results via ``torch.save``.
"""

import os
import pickle
import runpy
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "free_port", "run_module", "run_on_ranks"]


_WARM = "torchtitan_ext.tools.warm_ranks"  # the fork server imports it once


class RankError(RuntimeError):
    """A rank raised, or died without reporting."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, env, payload, timeout_s, init_process_group, out):
    os.environ.clear()  # the server's environment is the caller's at its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ[name] = os.environ[f"LOCAL_{name}"] = str(value)
    try:
        from torchtitan_ext import cpu_backend

        cpu_backend.apply()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if init_process_group:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        fn, args, kwargs = pickle.loads(payload)
        torch.save(fn(*args, **kwargs), Path(out, f"{rank}.pt"))
    except Exception:
        raise
    except BaseException:  # pytest.fail and the like, which torch's wrapper misses
        raise RuntimeError(traceback.format_exc()) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is saved: no rank pays its interpreter teardown


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]``, on gloo ranks.

    ``RankError`` carries the first failing rank's traceback or exit code (the
    others get 2 s to end, then are killed); ``TimeoutError`` names the ranks
    still running after ``timeout_s`` (a hang?). No process outlives the call.
    """
    name = f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks"
    payload = pickle.dumps((fn, args, kwargs))
    with tempfile.TemporaryDirectory(prefix="local-ranks-") as out:
        env = dict(os.environ)
        mp.get_context("forkserver").set_forkserver_preload([_WARM])
        common = (world_size, free_port(), env, payload, timeout_s, init_process_group)
        context = mp.start_processes(
            _entry, (*common, out), world_size, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(max(0.0, deadline - time.monotonic()), 2.0):
                if time.monotonic() >= deadline:
                    alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    raise TimeoutError(
                        f"{name}: rank(s) {alive} still running after "
                        f"{timeout_s:.0f} s (hang?); all processes killed"
                    )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise RankError(f"{name}: rank {e.error_index} failed: {e}") from None
        finally:
            for process in context.processes:
                process.kill()
                process.join(timeout=10)
        return [
            torch.load(Path(out, f"{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def run_module(module: str, args: list[str], env: dict[str, str], logs: str) -> None:
    """``python -m module *args`` on this rank, as torchrun's ranks run it (with
    ``env``), its output in ``logs/<rank>.log``: ``run_on_ranks(run_module, ...,
    init_process_group=False)`` is ``torchrun`` without an interpreter per rank.
    As in any forked child, ``atexit`` handlers do not run."""
    os.environ.update(env)
    rank = int(os.environ["RANK"])
    log = os.open(Path(logs, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if int(os.environ["WORLD_SIZE"]) > 1:
        torch.set_num_threads(1)  # run_train.sh's OMP_NUM_THREADS=1
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
