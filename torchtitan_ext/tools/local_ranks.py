"""The tests' and benchmarks' one launcher: a function on N gloo processes here.

On ``torch.multiprocessing``, with a hard timeout. Ranks fork from one server that
imported torchtitan on the CPU backend once (``warm_ranks``); each takes the
caller's environment and torchrun's, joins one gloo group on 127.0.0.1 (unless
``init_process_group=False``: a Trainer built in ``fn`` joins its own) and calls
``fn``, a picklable top-level function; results via ``torch.save``.

As torchrun's agent does, the launcher hosts the rendezvous store on a port the
OS picks before any rank starts (no free port to race a parallel launch for),
and the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE``); each rank's
``@record`` (torchtitan's Trainer) writes its error to ``TORCHELASTIC_ERROR_FILE``.
"""

import contextlib
import json
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
    """A rank raised, or died without reporting; ``errors``: what each rank's
    error file says (``{rank: "Type: message"}``), as torchrun reports it."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _error_file(out: str, rank: int) -> Path:
    """torchrun's ``<attempt log dir>/<local rank>/error.json``."""
    return Path(out, str(rank), "error.json")


def _error_files(out: str, world_size: int) -> dict[int, str]:
    """``{rank: message}`` of the ranks that wrote one, the first written first."""
    found = []
    for rank in range(world_size):
        with contextlib.suppress(OSError, ValueError, KeyError):
            error = json.loads(_error_file(out, rank).read_text())["message"]
            found.append((int(error["extraInfo"]["timestamp"]), rank, error["message"]))
    return {rank: message for _, rank, message in sorted(found)}


def _entry(rank, world_size, port, env, payload, timeout_s, init_process_group, out):
    os.environ.clear()  # the server's environment is the caller's at its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # torchrun's: the store at MASTER_PORT is the launcher's; @record's file.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(_error_file(out, rank))
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
    others get 2 s to end, then are killed) and every rank's error file;
    ``TimeoutError`` names the ranks still running after ``timeout_s`` (a
    hang?). No process outlives the call. One default process group per rank,
    as under torchrun: the store's keys last the whole call.
    """
    name = f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks"
    payload = pickle.dumps((fn, args, kwargs))
    # Port 0: the OS binds a free one, held until the call returns.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="local-ranks-") as out:
        for rank in range(world_size):
            _error_file(out, rank).parent.mkdir()
        env = dict(os.environ)
        mp.get_context("forkserver").set_forkserver_preload([_WARM])
        common = (world_size, store.port, env, payload, timeout_s, init_process_group)
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
            errors = _error_files(out, world_size)
            lines = "".join(f"\n  rank {r}: {m}" for r, m in errors.items())
            files = f"\nerror files, first written first:{lines}" if errors else ""
            message = f"{name}: rank {e.error_index} failed: {e}{files}"
            raise RankError(message, errors) from None
        finally:
            for process in context.processes:
                process.kill()
                process.join(timeout=10)
            del store  # its server closes now, not when a traceback lets it go
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
    # run_train.sh's OMP_NUM_THREADS: the caller's, else 1 if several ranks run.
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads or int(os.environ["WORLD_SIZE"]) > 1:
        torch.set_num_threads(int(threads or 1))
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
