"""The plug-in's real Trainer, one step at a time, for the CP benchmark scripts.

A benchmark started as a plain script re-runs itself under
``torch.distributed.run`` (``relaunch``); each worker then builds
``MuseGlimmerTrainer`` from a TOML job exactly as ``torchtitan_ext.train``
does (CPU backend first, the file's overrides, then the command line's), but
drives it step by step instead of calling ``train()``, so a script can time or
instrument what one step does with one batch.
"""

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

__all__ = [
    "Batch",
    "add_job_arguments",
    "barrier",
    "build_trainer",
    "clone_batch",
    "exit_worker",
    "in_worker",
    "is_rank0",
    "job_overrides",
    "relaunch",
    "run_on_ranks",
    "synchronize",
    "to_device",
    "train_step",
    "use_eager_cp_block_masks",
]

Batch = tuple[dict[str, Any], torch.Tensor]


def in_worker() -> bool:
    """Whether this process is a rank started by ``torch.distributed.run``."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_on_ranks(
    script: str,
    argv: Sequence[str] | None,
    parse: Callable[[Sequence[str] | None], tuple[argparse.Namespace, list[str]]],
    worker: Callable[[argparse.Namespace, list[str]], None],
) -> int:
    """A benchmark's ``main``: started plainly it reruns itself on ``--nproc`` ranks,
    each of which runs ``worker`` and leaves through ``exit_worker``."""
    args, extra = parse(argv)
    if not in_worker():
        return relaunch(script, sys.argv[1:] if argv is None else argv, args.nproc)
    worker(args, extra)
    exit_worker()


def exit_worker() -> NoReturn:
    """End a rank that finished its work, skipping the interpreter's teardown.

    That teardown has aborted in a C++ destructor ("terminate called without an
    active exception") after the results were written: three times in CI, in
    three different scripts, never when retried by hand.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def relaunch(script: str, argv: Sequence[str], nproc: int) -> int:
    """Run ``script argv`` on ``nproc`` local ranks; rank 0's output is shown."""
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--nproc_per_node", str(nproc)),
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"),
        *("--local-ranks-filter", "0", "--role", "rank"),
        script,
        *argv,
    ]
    return subprocess.run(command).returncode


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The CP job, its ranks and batch shape, and the unmeasured steps."""
    parser.add_argument("--config-file", default="train_configs/cp2.toml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--local-batch-size", type=int, default=2)
    parser.add_argument(
        "--max-images-per-batch",
        type=int,
        default=512,
        help="collator image budget; the job's 128 would drop rows at seq_len 2048",
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps")


def job_overrides(
    args: argparse.Namespace, measured_steps: int, dump_folder: str
) -> list[str]:
    """torchtitan flags for ``add_job_arguments``' values."""
    return [
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.local_batch_size)),
        *("--dataloader.max_images_per_batch", str(args.max_images_per_batch)),
        *("--training.steps", str(args.warmup + measured_steps)),
        *("--dump_folder", dump_folder),
    ]


def build_trainer(config_file: str, overrides: Sequence[str]):
    """``MuseGlimmerTrainer`` for ``config_file`` with ``overrides`` (CLI flags)."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from torchtitan_ext.config_file import merge_args
    from torchtitan_ext.tools.embedded_data import ensure_embedded_assets

    init_logger()
    ensure_embedded_assets()  # the debug jobs' data, as the launcher makes it
    args = merge_args(["--job.config_file", config_file, *overrides])
    config = ConfigManager().parse_args(args)
    trainer = config.build()
    if trainer.gradient_accumulation_steps != 1 or trainer.parallel_dims.pp_enabled:
        raise ValueError(
            "the CP benchmarks take one batch per step; got "
            f"{trainer.gradient_accumulation_steps} gradient accumulation steps and "
            f"pipeline_parallel_degree={trainer.parallel_dims.pp}"
        )
    return trainer


def to_device(trainer, batch: Batch) -> Batch:
    """``batch`` on the trainer's device, as ``train_step`` moves it."""
    input_dict, labels = batch
    input_dict = {
        key: value.to(trainer.device) if isinstance(value, torch.Tensor) else value
        for key, value in input_dict.items()
    }
    return input_dict, labels.to(trainer.device)


def clone_batch(batch: Batch) -> Batch:
    """A copy whose tensors a post-processing pass may not share with another."""
    input_dict, labels = batch
    return {
        key: value.clone() if isinstance(value, torch.Tensor) else value
        for key, value in input_dict.items()
    }, labels.clone()


def synchronize(trainer) -> None:
    """Wait for the trainer's device (a no-op on CPU)."""
    if trainer.device.type != "cpu":
        torch.accelerator.synchronize(trainer.device)


def barrier() -> None:
    torch.distributed.barrier()


def train_step(trainer, batch: Batch) -> float:
    """One ``Trainer.train_step`` on ``batch``: forward, backward, optimizer (ms)."""
    trainer.step += 1
    barrier()
    synchronize(trainer)
    start = time.perf_counter()
    trainer.train_step(iter([batch]))
    synchronize(trainer)
    return (time.perf_counter() - start) * 1e3


def batch_agreement(trainer, batch: Batch) -> float:
    """The Trainer's batch agreement check on the CPU ``batch`` (ms)."""
    barrier()
    start = time.perf_counter()
    trainer.batch_agreement.check(*batch, "the benchmark")
    return (time.perf_counter() - start) * 1e3


def is_rank0() -> bool:
    return torch.distributed.get_rank() == 0


def use_eager_cp_block_masks() -> None:
    """Build torch's CP block masks with eager ``create_block_mask``.

    ``cpu_backend`` does so on CPU; with an accelerator torch's CP mask rewrite
    compiles it with ``fullgraph=True``, which cannot trace under the Python
    mode that counts host syncs. The masks are the same.
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask
