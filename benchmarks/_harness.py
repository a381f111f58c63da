"""The benchmarks' one harness: ``measure(args, trainer)`` on local gloo ranks.

Each rank builds the plug-in's Trainer as ``torchtitan_ext.train`` does, and a
``report`` turns the ranks' results into a table and JSON. The job is a CP
job's (``job_parser``, ``run_job``) or the packed debug job at each ``--cp``
degree on one synthetic row (``degree_parser``, ``run_degrees``), with RoPE
sized to ``--seq-len`` (the flavor stops at 4096) and float32 parameters at
every degree (FSDP, on at CP > 1, would compute in bf16 and CP1 in fp32).
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from torchtitan_ext.tools.local_ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
PACKED_JOB = str(REPO / "train_configs" / "packed.toml")
OUTPUTS = REPO / "outputs" / "benchmarks"

Batch = tuple[dict[str, Any], torch.Tensor]


def load_config(job: Sequence[str], layers: int = 0):
    """The Trainer config of torchtitan flags ``job`` (CPU backend without an
    accelerator), its first ``layers`` decoder layers (0: all) with RoPE tables
    of at least its seq_len."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    from torchtitan_ext.config_file import load_job

    config = load_job(list(job))
    model = config.model_spec.model
    if not 0 <= layers <= len(model.layers):
        raise ValueError(
            f"--layers {layers} must be in 1..{len(model.layers)} (the flavor's)"
        )
    model.layers = model.layers[: layers or None]
    for layer in model.layers:
        rope = layer.attention.rope
        seq_len = max(config.training.seq_len, rope.max_seq_len)
        layer.attention.rope = dataclasses.replace(rope, max_seq_len=seq_len)
    return config


def build_trainer(job: Sequence[str], layers: int = 0, one_batch=True):
    """``load_config``'s Trainer; with ``one_batch``, refused if a step would
    take several batches (the CP benchmarks feed one)."""
    config = load_config(job, layers)
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = config.build()
    if not one_batch:
        return trainer
    if trainer.gradient_accumulation_steps != 1 or trainer.parallel_dims.pp_enabled:
        raise ValueError(
            "the CP benchmarks take one batch per step; got "
            f"{trainer.gradient_accumulation_steps} gradient accumulation steps and "
            f"pipeline_parallel_degree={trainer.parallel_dims.pp}"
        )
    return trainer


def job_parser(doc: str, json_name: str, steps: int) -> argparse.ArgumentParser:
    """A CP job; flags it does not know are torchtitan's (``run_job``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    add = parser.add_argument
    add("--config-file", default="train_configs/cp2.toml")
    add("--nproc", type=int, default=2)
    add("--seq-len", type=int, default=2048)
    add("--local-batch-size", type=int, default=2)
    # The job's collator budget of 128 images would drop rows at seq_len 2048.
    add("--max-images-per-batch", type=int, default=512)
    add("--warmup", type=int, default=1, help="unmeasured steps")
    add("--steps", type=int, default=steps, help="measured steps")
    add("--json", type=Path, default=OUTPUTS / json_name)
    return parser


def _on_ranks(nproc: int, measure, args, job: list[str], timeout_s=3600.0, **kwargs):
    # The Trainer joins the process group itself, as under torchrun.
    kwargs |= {"timeout_s": timeout_s, "init_process_group": False}
    return run_on_ranks(_worker, nproc, measure, args, job, **kwargs)


def _worker(measure: Callable, args, job: list[str], layers=0, need_cp=False, **kw):
    """This rank's ``measure(args, trainer)`` on the Trainer of flags ``job``
    (``build_trainer``'s keywords ``kw``), and what a report says of the job."""
    trainer = build_trainer(job, layers, **kw)
    try:
        if need_cp and not trainer.parallel_dims.cp_enabled:
            raise ValueError(f"{job[1]} does not enable context parallelism")
        result = measure(args, trainer)
        config = trainer.config
        return result, {
            "device": trainer.device.type,
            "cp": trainer.parallel_dims.cp,
            "seq_len": config.training.seq_len,
            "local_batch_size": config.training.local_batch_size,
            "load_balancer": config.parallelism.context_parallel_load_balancer,
        }
    finally:
        trainer.close()


def run_job(parser: argparse.ArgumentParser, argv, measure, report) -> int:
    """``measure(args, trainer)`` on ``--nproc`` ranks; ``report(args, job,
    results)`` gives the text to print and what the JSON adds to the job."""
    args, extra = parser.parse_known_args(argv)
    flags = [
        *("--job.config_file", args.config_file),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.local_batch_size)),
        *("--dataloader.max_images_per_batch", str(args.max_images_per_batch)),
        *("--training.steps", str(args.warmup + args.steps)),
        *("--dump_folder", str(args.json.parent / f"{args.json.stem}_run")),
    ]
    results = _on_ranks(args.nproc, measure, args, [*flags, *extra], need_cp=True)
    job = results[0][1]
    text, result = report(args, job, [result for result, _ in results])
    print(
        f"\n{args.config_file}: cp {job['cp']}, seq_len {job['seq_len']}, local "
        f"batch {job['local_batch_size']}, {job['load_balancer']} balancer, "
        f"{job['device']}; {text}"
    )
    args_json = vars(args) | {"torchtitan_args": extra}
    write_json(args.json, {"args": args_json, **job, **result})
    return 0


def row_parser(doc: str, *, seq_len: int, images: list[int], tokens: int, json: str):
    """One synthetic row's shape, checked by ``parse_row``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    add = parser.add_argument
    add("--seq-len", type=int, default=seq_len)
    add("--images", type=int, nargs="+", default=list(images), help="per row")
    add("--tokens-per-image", type=int, default=tokens)
    add("--json", type=Path, default=OUTPUTS / json)
    return parser


def degree_parser(doc: str, *, cp: Sequence[int], **row) -> argparse.ArgumentParser:
    from _vision_modes import VISION_MODES

    parser = row_parser(doc, **{"tokens": 64} | row)
    add = parser.add_argument
    add("--cp", type=int, nargs="+", default=list(cp))
    # 4 decoder layers or more keep the global-attention layer ptrr needs.
    add("--layers", type=int, default=4)
    add("--vision", nargs="+", choices=VISION_MODES, default=list(VISION_MODES))
    add("--timeout-s", type=float, default=3600.0, help="per CP degree's launch")
    return parser


def parse_row(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    args = parser.parse_args(argv)
    tokens = args.tokens_per_image
    if round(tokens**0.5) ** 2 != tokens:
        parser.error(f"--tokens-per-image must be a square; got {tokens}")
    for images in args.images:
        if images < 1 or 2 * images * tokens > args.seq_len:
            parser.error(
                f"--images {images} x --tokens-per-image {tokens} must be >= 1 "
                f"image and fill at most half of --seq-len {args.seq_len}"
            )
    return args


def degree_job(args: argparse.Namespace, cp: int, dump: str) -> list[str]:
    return [
        *("--job.config_file", PACKED_JOB),
        *("--parallelism.context_parallel_degree", str(cp)),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", "1"),
        *("--training.mixed_precision_param", "float32"),
        *("--dump_folder", dump),
    ]


def run_degrees(args: argparse.Namespace, measure, row, report) -> None:
    """``measure(args, trainer)`` (module-level: it is pickled) on N ranks for
    each ``--cp`` N gives each rank's rows, one per images count (and mode);
    ``row(args, that row of every rank)`` adds to its CP, images and vision
    tokens; ``report(args, rows)`` gives the text (and may add to the rows)."""
    rows = []
    for cp in args.cp:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump:
            job = degree_job(args, cp, dump)
            results = _on_ranks(
                cp, measure, args, job, args.timeout_s, layers=args.layers
            )
        for rank_rows in zip(*(rank for rank, _ in results), strict=True):
            images = rank_rows[0]["images"]
            tokens = images * args.tokens_per_image
            facts = {"cp": cp, "images": images, "vision_tokens": tokens}
            rows.append(facts | row(args, list(rank_rows)))
        print(f"CP{cp}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(report(args, rows))
    write_json(args.json, {"settings": vars(args), "rows": rows})


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nJSON: {path}")


def table(columns: Sequence[tuple], rows: Iterable[dict], left=()) -> str:
    """A markdown table of dict ``rows``, right-aligned but for the ``left``
    titles: a (title, cell) per column, the cell a ``format_map`` string for
    the row ("-" where the row lacks a key) or a function of it."""

    def text(cell, row: dict) -> str:
        with contextlib.suppress(KeyError):
            return cell(row) if callable(cell) else cell.format_map(row)
        return "-"

    titles = [title for title, _ in columns]
    lines = ["| " + " | ".join(titles) + " |"]
    lines.append("|" + "".join(" --- |" if t in left else " ---: |" for t in titles))
    lines += ["| " + " | ".join(text(c, r) for _, c in columns) + " |" for r in rows]
    return "\n".join(lines)


def to_device(trainer, batch: Batch) -> Batch:
    return tree_map_only(torch.Tensor, lambda t: t.to(trainer.device), batch)


def clone_batch(batch: Batch) -> Batch:
    """A copy whose tensors a post-processing pass may not share with another."""
    return tree_map_only(torch.Tensor, torch.Tensor.clone, batch)


def synchronize(trainer) -> None:
    if trainer.device.type != "cpu":
        torch.accelerator.synchronize(trainer.device)


def timed_ms(trainer, fn, *args) -> tuple[float, float]:
    """Wall and process CPU time of ``fn(*args)`` (ms), from a barrier to the
    device's end; CPU time leaves out the time other processes held the cores."""
    torch.distributed.barrier()
    synchronize(trainer)
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    synchronize(trainer)
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def forward_backward_ms(forward, grad, sync=lambda: None):
    """``forward()``'s output and ms per phase: it, its backward from ``grad``
    and both, each phase ended by ``sync()`` (the device's end)."""
    start = time.perf_counter()
    out = forward()
    sync()
    forward_end = time.perf_counter()
    out.backward(grad)
    sync()
    end = time.perf_counter()
    seconds = (forward_end - start, end - forward_end, end - start)
    phases = ("forward_ms", "backward_ms", "total_ms")
    return {p: s * 1e3 for p, s in zip(phases, seconds, strict=True)}, out


def train_step(trainer, batch: Batch) -> float:
    """``Trainer.train_step`` (ms) on one batch, as the training loop calls it."""
    trainer.step += 1
    return timed_ms(trainer, trainer.train_step, iter([batch]))[0]


def synthetic_batch(model, seq_len: int, images: int, tokens, rows=1):
    """CPU rows of model config ``model``, as the memory planner plans them (the
    two compare); ``tokens`` per image, None: the planner's default size."""
    from torchtitan_ext.tools.estimate import batch

    shape = dict(seq_len=seq_len, images=images)
    size = batch.image_size(model.vision_encoder, **shape, tokens_per_image=tokens)
    return batch.synthetic_batch(model, rows=rows, **shape, size=size)


def row_batch(args, trainer, images: int, seq_len: int | None = None):
    """``synthetic_batch`` of ``row_parser``'s shape for ``trainer``'s model."""
    seq_len = seq_len or args.seq_len
    return synthetic_batch(trainer.model_config, seq_len, images, args.tokens_per_image)


def in_pairs(variants: dict[str, Callable[[], Any]], pairs: int) -> dict[str, list]:
    """Each variant's results, once per pair, in reverse order every other pair:
    on a busy host the load drifts over minutes, and alternating lets the drift
    hit the variants alike (a pair's ratio shares its noise)."""
    results = {name: [] for name in variants}
    for pair in range(pairs):
        for name in list(variants)[:: 1 if pair % 2 == 0 else -1]:
            results[name].append(variants[name]())
    return results


def median_pair_ratio(
    numerators: Sequence[float], denominators: Sequence[float]
) -> tuple[float, list[float]]:
    """Median and [first, third] quartiles of the pairs' ratios."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [quartiles[0], quartiles[2]]
