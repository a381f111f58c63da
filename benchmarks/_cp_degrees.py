"""The registry debug job on one synthetic row, one torchrun launch per CP degree.

For the scripts that compare CP degrees (``memory_per_rank``) or CP vision
modes (``vision_time_per_rank``, ``step_time_vision``): each rank builds the
plug-in's ``MuseGlimmerTrainer`` from the registry job
``muse_glimmer_debugmodel_mm_packed`` with ``--parallelism.context_parallel_degree
N`` (for N = 2 that is ``muse_glimmer_debugmodel_mm_cp2``: ptrr balancer, FSDP
over cp, selective AC), float32 parameters at every degree (FSDP, on at CP > 1,
would compute in bf16 and CP1 in fp32), and feeds it one ``--seq-len`` row
holding ``--images`` images of ``--tokens-per-image`` placeholders each, spread
evenly. The debug model is changed only where the long sequence needs it: RoPE
tables sized to ``--seq-len`` (the flavor stops at 4096) and ``--layers``
decoder layers (the flavor's 8; 4 keep one window pattern).

Started plainly, a script (``main``) reruns itself under
``torch.distributed.run`` once per ``--cp`` degree with its own arguments plus
``--worker-out``; there each rank measures, and rank 0 writes every rank's rows
to that file for the plain process to report.
"""

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import _cp_step  # benchmarks/, first on sys.path when run as a script
import torch

__all__ = [
    "MIB",
    "REPO",
    "build_trainer",
    "main",
    "parse",
    "parser",
    "synthetic_batch",
    "table",
]

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def parser(
    doc: str,
    *,
    seq_len: int,
    cp: Sequence[int],
    images: Sequence[int],
    json_name: str,
) -> argparse.ArgumentParser:
    """The batch, model, CP degrees and vision modes, and where the JSON goes."""
    from _vision_modes import VISION_MODES

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--cp", type=int, nargs="+", default=list(cp))
    parser.add_argument("--images", type=int, nargs="+", default=list(images))
    parser.add_argument("--tokens-per-image", type=int, default=64)
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
        "--json", type=Path, default=REPO / "outputs" / "benchmarks" / json_name
    )
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, help="per CP degree's launch"
    )
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``parser``'s arguments, the batch checked to fit the row."""
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


def main(
    script: str,
    argv: Sequence[str] | None,
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    measure: Callable[[argparse.Namespace, object], list[dict]],
    report: Callable[[argparse.Namespace, dict], tuple[str, list[dict]]],
) -> None:
    """A script's ``main``. On a rank: ``measure(args, trainer)``. Started
    plainly: one launch per CP degree, then ``report(args, {cp: each rank's
    rows})`` gives the text to print and the rows for the JSON."""
    args = parse_args(argv)
    if args.worker_out is not None:
        _run_worker(args, measure)
        return
    text, rows = report(args, _run_cp_degrees(script, args, argv))
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker_out")}
    args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    print(f"\nJSON: {args.json}")


def table(
    columns: Sequence[str], rows: Iterable[Sequence[str]], left: Sequence[str] = ()
) -> str:
    """A markdown table, right-aligned but for the ``left`` columns."""
    align = "".join(" --- |" if c in left else " ---: |" for c in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + align]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- worker side


def _job_args(args: argparse.Namespace, cp: int, dump: str) -> list[str]:
    return [
        *("--module", "torchtitan_ext.muse_glimmer"),
        *("--config", "muse_glimmer_debugmodel_mm_packed"),
        *("--parallelism.context_parallel_degree", str(cp)),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", "1"),
        *("--training.mixed_precision_param", "float32"),
        *("--dump_folder", dump),
    ]


def _fit_model(model_config, seq_len: int, layers: int) -> None:
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


def build_trainer(args: argparse.Namespace, dump: str):
    """This rank's Trainer for the job, one CP group over all ranks."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    from torchtitan.config import ConfigManager

    from torchtitan_ext.tools.embedded_data import ensure_embedded_assets

    ensure_embedded_assets()  # the debug jobs' data, as the launcher makes it
    config = ConfigManager().parse_args(_job_args(args, world, dump))
    _fit_model(config.model_spec.model, args.seq_len, args.layers)
    return config.build()


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


def _run_worker(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, object], list[dict]],
) -> None:
    """This rank's Trainer measured; rank 0 writes every rank's rows."""
    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(args, dump)
        try:
            rows = measure(args, trainer)
        finally:
            trainer.close()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if torch.distributed.get_rank() == 0:
        args.worker_out.write_text(json.dumps(gathered))
    torch.distributed.destroy_process_group()
    _cp_step.exit_worker()


# ---------------------------------------------------------------- driver side


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_cp_degrees(
    script: str, args: argparse.Namespace, argv: Sequence[str] | None
) -> dict[int, list[list[dict]]]:
    """``script argv`` on N ranks for each ``--cp`` N: every rank's rows, by N."""
    argv = sys.argv[1:] if argv is None else list(argv)
    per_cp = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            out = Path(tmp) / f"cp{cp}.json"
            command = [
                sys.executable,
                *("-m", "torch.distributed.run", "--nproc_per_node", str(cp)),
                *("--master_addr", "127.0.0.1", "--master_port", str(_free_port())),
                script,
                *argv,
                *("--worker-out", str(out)),
            ]
            start = time.perf_counter()
            run = subprocess.run(
                command,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
            )
            if run.returncode != 0:
                raise RuntimeError(
                    f"CP{cp} run failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
                )
            print(f"CP{cp}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            per_cp[cp] = json.loads(out.read_text())
    return per_cp
