"""The benchmarks' one harness: the plug-in's real Trainer on local gloo ranks.

A script's ``main`` parses its arguments and runs a worker on N spawned ranks
(``run_on_ranks``, the tests' launcher too); each worker builds
``MuseGlimmerTrainer`` from a TOML job exactly as ``torchtitan_ext.train``
does (``build_trainer``: CPU backend, the file, then the overrides) and drives
it a step at a time (``train_step``), so a script can time or instrument what
one step does with one batch; the workers' results come back to ``main``,
which prints a table and writes JSON.

Two kinds of job: a script's own TOML job on its own data (``add_job_arguments``,
``host_syncs`` and ``preprocessing_overhead``), or the packed debug job at each
``--cp`` degree on one synthetic row (``degree_parser``, ``run_degrees``:
``memory_per_rank`` and ``vision_time``). There the debug model is changed only
where the long row needs it: RoPE tables sized to ``--seq-len`` (the flavor
stops at 4096) and ``--layers`` decoder layers (the flavor's 8; 4 keep one
window pattern), float32 parameters at every degree (FSDP, on at CP > 1, would
compute in bf16 and CP1 in fp32).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from torchtitan_ext.tools.local_ranks import run_on_ranks

__all__ = [
    "MIB",
    "PACKED_JOB",
    "REPO",
    "Batch",
    "add_job_arguments",
    "alternating",
    "barrier",
    "batch_agreement",
    "build_trainer",
    "clone_batch",
    "degree_job",
    "degree_parser",
    "exit_worker",
    "fit_model",
    "build_job_trainer",
    "job_summary",
    "median_pair_ratio",
    "on_ranks",
    "phase",
    "run_job",
    "parse_degrees",
    "run_degrees",
    "synchronize",
    "synthetic_batch",
    "table",
    "to_device",
    "train_step",
    "use_eager_cp_block_masks",
    "write_json",
]

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
PACKED_JOB = str(REPO / "train_configs" / "packed.toml")

Batch = tuple[dict[str, Any], torch.Tensor]


# ------------------------------------------------------------ launch and build


def on_ranks(worker: Callable, nproc: int, *args, timeout_s: float = 3600.0):
    """``worker(*args)`` on ``nproc`` local ranks; every rank's result.

    The Trainer the worker builds joins the process group itself, as under
    torchrun; each rank runs ``cpu_count / nproc`` threads.
    """
    return run_on_ranks(
        worker, nproc, *args, timeout_s=timeout_s, init_process_group=False
    )


def exit_worker() -> None:
    """End a process that finished its work, skipping the interpreter's teardown.

    That teardown has aborted in a C++ destructor ("terminate called without an
    active exception") after the results were written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_trainer(config_file: str, overrides: Sequence[str], layers: int = 0):
    """``MuseGlimmerTrainer`` for ``config_file`` with ``overrides`` (CLI flags),
    its RoPE tables sized to the job's seq_len and, if ``layers``, that many
    decoder layers."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    from torchtitan.tools.logging import init_logger

    from torchtitan_ext.tools.simulated_cluster import load_job

    init_logger()
    config = load_job(["--job.config_file", config_file, *overrides])
    model = config.model_spec.model
    fit_model(model, config.training.seq_len, layers or len(model.layers))
    trainer = config.build()
    if trainer.gradient_accumulation_steps != 1 or trainer.parallel_dims.pp_enabled:
        raise ValueError(
            "the CP benchmarks take one batch per step; got "
            f"{trainer.gradient_accumulation_steps} gradient accumulation steps and "
            f"pipeline_parallel_degree={trainer.parallel_dims.pp}"
        )
    return trainer


def fit_model(model_config, seq_len: int, layers: int) -> None:
    """The first ``layers`` decoder layers, RoPE tables of at least ``seq_len``."""
    if not 1 <= layers <= len(model_config.layers):
        raise ValueError(
            f"--layers {layers} must be in 1..{len(model_config.layers)} "
            "(the flavor's decoder layers)"
        )
    model_config.layers = model_config.layers[:layers]
    for layer in model_config.layers:
        layer.attention.rope = dataclasses.replace(
            layer.attention.rope,
            max_seq_len=max(seq_len, layer.attention.rope.max_seq_len),
        )


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """A script's TOML job, its ranks and batch shape, and the unmeasured steps."""
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


def build_job_trainer(
    args: argparse.Namespace, extra: Sequence[str], measured_steps: int, dump: str
):
    """The Trainer of ``add_job_arguments``' CP job, ``extra`` flags last."""
    overrides = [
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.local_batch_size)),
        *("--dataloader.max_images_per_batch", str(args.max_images_per_batch)),
        *("--training.steps", str(args.warmup + measured_steps)),
        *("--dump_folder", str(args.json.parent / dump)),
    ]
    trainer = build_trainer(args.config_file, [*overrides, *extra])
    if not trainer.parallel_dims.cp_enabled:
        trainer.close()
        raise ValueError(f"{args.config_file} does not enable context parallelism")
    return trainer


def run_job(parsed: tuple[argparse.Namespace, list[str]], worker, report) -> int:
    """A TOML-job script's ``main``: ``worker(args, extra)`` on ``--nproc``
    ranks returns (this rank's summary, ``job_summary``); ``report(args, extra,
    job, summaries)`` prints and writes them."""
    args, extra = parsed
    results = on_ranks(worker, args.nproc, args, extra)
    report(args, extra, results[0][1], [summary for summary, _ in results])
    return 0


@contextlib.contextmanager
def phase(holder, name: str):
    """``holder.phase`` is ``name`` for the ``with``."""
    previous, holder.phase = holder.phase, name
    try:
        yield
    finally:
        holder.phase = previous


def job_summary(trainer) -> dict:
    """What a report says of the job a worker ran."""
    config = trainer.config
    return {
        "device": trainer.device.type,
        "cp": trainer.parallel_dims.cp,
        "seq_len": config.training.seq_len,
        "local_batch_size": config.training.local_batch_size,
        "load_balancer": config.parallelism.context_parallel_load_balancer,
    }


# ------------------------------------------------------------------ one step


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


def use_eager_cp_block_masks() -> None:
    """Build torch's CP block masks with eager ``create_block_mask``.

    ``cpu_backend`` does so on CPU; with an accelerator torch's CP mask rewrite
    compiles it with ``fullgraph=True``, which cannot trace under the Python
    mode that counts host syncs. The masks are the same.
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask


def synthetic_batch(trainer, seq_len: int, images: int, tokens_per_image: int):
    """One CPU row: text, with ``images`` evenly spaced placeholder spans."""
    from torchtitan.components.loss import IGNORE_INDEX

    encoder = trainer.model_config.vision_encoder
    merge = encoder.downsample_factor
    side = round(tokens_per_image**0.5) * merge
    image_id = trainer.tokenizer.image_id
    special = {
        f"{name}_id": getattr(trainer.tokenizer, f"{name}_id")
        for name in trainer.tokenizer.TOKEN_FIELDS
    }
    generator = torch.Generator().manual_seed(0)
    reserved = torch.tensor(sorted(v for v in special.values() if v is not None))
    tokens_1L = torch.randint(
        0, trainer.model_config.vocab_size, (1, seq_len + 1), generator=generator
    )
    tokens_1L[torch.isin(tokens_1L, reserved)] = 1
    stride = seq_len // images
    for image in range(images):
        start = image * stride + 1
        tokens_1L[0, start : start + tokens_per_image] = image_id
    labels_1L = tokens_1L[:, 1:].clone()
    labels_1L[labels_1L == image_id] = IGNORE_INDEX
    input_dict = {
        "input": tokens_1L[:, :-1],
        "positions": torch.arange(seq_len).unsqueeze(0),
        "pixel_values": torch.randn(
            images, side * side, encoder.conv1.in_features, generator=generator
        ),
        "grid_thw": torch.tensor([[1, side, side]] * images),
        "special_tokens": special,
    }
    return input_dict, labels_1L


# ------------------------------------------------------- one row, CP degrees


def degree_parser(
    doc: str,
    *,
    seq_len: int,
    cp: Sequence[int],
    images: Sequence[int],
    json: str,
    tokens_per_image: int = 64,
) -> argparse.ArgumentParser:
    """The row, model, CP degrees and vision modes, and where the JSON goes."""
    from _vision_modes import VISION_MODES

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--cp", type=int, nargs="+", default=list(cp))
    parser.add_argument("--images", type=int, nargs="+", default=list(images))
    parser.add_argument("--tokens-per-image", type=int, default=tokens_per_image)
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="decoder layers; 4 or more keep the global-attention layer ptrr needs",
    )
    parser.add_argument(
        "--vision",
        nargs="+",
        choices=VISION_MODES,
        default=list(VISION_MODES),
        help="parallelism.context_parallel_vision modes, each measured per launch",
    )
    parser.add_argument(
        "--json", type=Path, default=REPO / "outputs" / "benchmarks" / json
    )
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, help="per CP degree's launch"
    )
    return parser


def parse_degrees(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``degree_parser``'s arguments, the images checked to fit the row."""
    args = parser.parse_args(argv)
    side = round(args.tokens_per_image**0.5)
    if side * side != args.tokens_per_image:
        parser.error(
            f"--tokens-per-image must be a square; got {args.tokens_per_image}"
        )
    for images in args.images:
        if images < 1 or 2 * images * args.tokens_per_image > args.seq_len:
            parser.error(
                f"--images {images} x --tokens-per-image {args.tokens_per_image} "
                f"must be >= 1 image and fill at most half of --seq-len {args.seq_len}"
            )
    return args


def degree_job(args: argparse.Namespace, cp: int, dump: str) -> list[str]:
    """The packed debug job's flags at CP ``cp`` on one ``--seq-len`` row."""
    return [
        *("--parallelism.context_parallel_degree", str(cp)),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", "1"),
        *("--training.mixed_precision_param", "float32"),
        *("--dump_folder", dump),
    ]


def _degree_worker(measure: Callable, args: argparse.Namespace) -> list[dict]:
    """This rank's Trainer at CP = world size, measured by ``measure``."""
    cp = int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(PACKED_JOB, degree_job(args, cp, dump), args.layers)
        try:
            return measure(args, trainer)
        finally:
            trainer.close()


def run_degrees(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, object], list[dict]],
    report: Callable[[argparse.Namespace, dict], tuple[str, list[dict]]],
) -> None:
    """``measure(args, trainer)`` on N ranks for each ``--cp`` N; then
    ``report(args, {cp: each rank's rows})`` gives the text and the JSON rows.
    ``measure`` must be a module-level function (it is pickled to the ranks)."""
    per_cp = {}
    for cp in args.cp:
        start = time.perf_counter()
        per_cp[cp] = on_ranks(
            _degree_worker, cp, measure, args, timeout_s=args.timeout_s
        )
        print(f"CP{cp}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    text, rows = report(args, per_cp)
    print(text)
    write_json(args.json, {"settings": vars(args), "rows": rows})


# ------------------------------------------------------------------ reporting


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nJSON: {path}")


def table(
    columns: Sequence[str], rows: Iterable[Sequence[str]], left: Sequence[str] = ()
) -> str:
    """A markdown table, right-aligned but for the ``left`` columns."""
    align = "".join(" --- |" if c in left else " ---: |" for c in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + align]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def alternating(variants: Sequence, pairs: int) -> Iterator[Sequence]:
    """``variants`` once per pair, in reverse order every other pair.

    On a busy host the load drifts over minutes; alternating the order lets
    the drift hit both variants alike, and a pair's ratio shares its noise.
    """
    for pair in range(pairs):
        yield variants if pair % 2 == 0 else variants[::-1]


def median_pair_ratio(
    numerators: Sequence[float], denominators: Sequence[float]
) -> tuple[float, list[float]]:
    """Median and [first, third] quartiles of the pairs' ratios."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [quartiles[0], quartiles[2]]
