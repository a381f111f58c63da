"""The benchmarks' one harness: the plug-in's real Trainer on local gloo ranks.

A script runs ``measure(args, trainer)`` on N spawned ranks, each with a
Trainer built from a TOML job as ``torchtitan_ext.train`` builds it, then a
``report`` turns the ranks' results into a printed table and JSON. The job is
a script's own (``job_parser``, ``run_job``) or the packed debug job at each
``--cp`` degree on one synthetic row (``degree_parser``, ``run_degrees``),
with RoPE sized to ``--seq-len`` (the flavor stops at 4096), ``--layers``
decoder layers and float32 parameters at every degree (FSDP, on at CP > 1,
would compute in bf16 and CP1 in fp32).
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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from torchtitan_ext.tools.local_ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
PACKED_JOB = str(REPO / "train_configs" / "packed.toml")
OUTPUTS = REPO / "outputs" / "benchmarks"

Batch = tuple[dict[str, Any], torch.Tensor]


def load_config(job: Sequence[str], layers: int = 0):
    """The Trainer config of torchtitan flags ``job`` (CPU backend without an
    accelerator), RoPE sized to its seq_len and, if ``layers``, that many layers."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    from torchtitan_ext.tools.simulated_cluster import load_job

    config = load_job(list(job))
    model = config.model_spec.model
    fit_model(model, config.training.seq_len, layers or len(model.layers))
    return config


def build_trainer(job: Sequence[str], layers: int = 0):
    """``load_config``'s Trainer, refused if a step would take several batches."""
    config = load_config(job, layers)
    from torchtitan.tools.logging import init_logger

    init_logger()
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


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``low``."""

    def parse(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return int(text)

    return parse


def job_parser(doc: str, json_name: str, steps: int) -> argparse.ArgumentParser:
    """A CP job (unknown flags are torchtitan's), its ranks, batch shape, steps
    and JSON."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    add = parser.add_argument
    add("--config-file", default="train_configs/cp2.toml")
    add("--nproc", type=int, default=2)
    add("--seq-len", type=int, default=2048)
    add("--local-batch-size", type=int, default=2)
    add(
        "--max-images-per-batch",
        type=int,
        default=512,
        help="collator image budget; the job's 128 would drop rows at seq_len 2048",
    )
    add("--warmup", type=at_least(0), default=1, help="unmeasured steps")
    add("--steps", type=at_least(1), default=steps, help="measured steps")
    add("--json", type=Path, default=OUTPUTS / json_name)
    return parser


def _on_ranks(nproc: int, measure, args, job: list[str], timeout_s=3600.0, **kwargs):
    """Each rank's ``_worker`` result; the Trainer joins the process group
    itself, as under torchrun."""
    return run_on_ranks(
        *(_worker, nproc, measure, args, job),
        timeout_s=timeout_s,
        init_process_group=False,
        **kwargs,
    )


def _worker(measure: Callable, args, job: list[str], layers=0, need_cp=False):
    """This rank's ``measure(args, trainer)`` on the Trainer of flags ``job``,
    and what a report says of the job (with the host's load average)."""
    load_at_start = os.getloadavg()
    trainer = build_trainer(job, layers)
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
            "load_average": {"start": load_at_start, "end": os.getloadavg()},
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


@contextlib.contextmanager
def phase(holder, name: str):
    """``holder.phase`` is ``name`` for the ``with``."""
    previous, holder.phase = holder.phase, name
    try:
        yield
    finally:
        holder.phase = previous


def to_device(trainer, batch: Batch) -> Batch:
    """``batch`` on the trainer's device, as ``train_step`` moves it."""
    return _map_tensors(batch, lambda tensor: tensor.to(trainer.device))


def clone_batch(batch: Batch) -> Batch:
    """A copy whose tensors a post-processing pass may not share with another."""
    return _map_tensors(batch, torch.Tensor.clone)


def _map_tensors(batch: Batch, fn: Callable) -> Batch:
    input_dict, labels = batch
    return {
        key: fn(value) if isinstance(value, torch.Tensor) else value
        for key, value in input_dict.items()
    }, fn(labels)


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


def train_step(trainer, batch: Batch) -> float:
    """One ``Trainer.train_step`` on ``batch``: forward, backward, optimizer (ms)."""
    trainer.step += 1
    return timed_ms(trainer, trainer.train_step, iter([batch]))[0]


def synthetic_batch(trainer, seq_len: int, images: int, tokens_per_image: int):
    """One CPU row: text, with ``images`` evenly spaced placeholder spans."""
    from torchtitan.components.loss import IGNORE_INDEX

    encoder = trainer.model_config.vision_encoder
    side = round(tokens_per_image**0.5) * encoder.downsample_factor
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
    add = parser.add_argument
    add("--seq-len", type=int, default=seq_len)
    add("--cp", type=int, nargs="+", default=list(cp))
    add("--images", type=int, nargs="+", default=list(images))
    add("--tokens-per-image", type=int, default=tokens_per_image)
    add(
        "--layers",
        type=int,
        default=4,
        help="decoder layers; 4 or more keep the global-attention layer ptrr needs",
    )
    add(
        "--vision",
        nargs="+",
        choices=VISION_MODES,
        default=list(VISION_MODES),
        help="parallelism.context_parallel_vision modes, each measured per launch",
    )
    add("--json", type=Path, default=OUTPUTS / json)
    add("--timeout-s", type=float, default=3600.0, help="per CP degree's launch")
    return parser


def parse_degrees(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parser's arguments, the images checked to fit the row."""
    args = parser.parse_args(argv)
    if round(args.tokens_per_image**0.5) ** 2 != args.tokens_per_image:
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


def run_degrees(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, object], list[dict]],
    report: Callable[[argparse.Namespace, dict], tuple[str, list[dict]]],
) -> None:
    """``measure(args, trainer)`` (module-level: it is pickled) on N ranks for
    each ``--cp`` N; ``report(args, {cp: each rank's rows})`` gives the text and
    the JSON rows."""
    per_cp = {}
    for cp in args.cp:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump:
            job = ["--job.config_file", PACKED_JOB, *degree_job(args, cp, dump)]
            results = _on_ranks(
                cp, measure, args, job, args.timeout_s, layers=args.layers
            )
        per_cp[cp] = [rows for rows, _ in results]
        print(f"CP{cp}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    text, rows = report(args, per_cp)
    print(text)
    write_json(args.json, {"settings": vars(args), "rows": rows})


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


def row_table(
    columns: Sequence[tuple[str, str | Callable[[dict], str]]],
    rows: Iterable[dict],
    left: Sequence[str] = (),
) -> str:
    """``table`` of dict ``rows``: a (title, cell) per column, the cell a
    ``format_map`` string for the row or a function of it."""
    cells = (
        [cell(row) if callable(cell) else cell.format_map(row) for _, cell in columns]
        for row in rows
    )
    return table([title for title, _ in columns], cells, left)


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
