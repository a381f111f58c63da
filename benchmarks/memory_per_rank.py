"""Peak tensor memory per rank of one training step, CP1 vs CP2 vs CP4.

Each CP degree runs under torchrun on gloo ranks with the real stack: the
plug-in's ``MuseGlimmerTrainer`` built from the registry job
``muse_glimmer_debugmodel_mm_packed`` with ``--parallelism.context_parallel_degree
N`` (for N = 2 that is ``muse_glimmer_debugmodel_mm_cp2``: ptrr balancer,
FSDP over cp, selective AC), and one ``train_step`` (forward, backward,
optimizer) on a synthetic batch of one ``--seq-len`` row holding ``--images``
images of ``--tokens-per-image`` placeholders each, spread evenly.

Memory is *allocated tensor storage*, not RSS: ``_live_memory.LiveMemory``
(a ``TorchDispatchMode``) counts every storage an op creates until it dies,
filed by phase and region (vision modules ``VISION_MODULE_FQNS`` or decoder):

- decoder / vision activations: peak live bytes allocated in forward (the
  activations saved for backward, plus forward temporaries), without the
  attention kernel's scratch;
- attention scratch: the eager dense flex kernel of the CPU backend builds
  [B, H, Lq, Lk] fp32 score matrices (GiBs at 8192 tokens) that a fused GPU
  kernel never stores; peak over forward and backward, its own column;
- step peak: parameters, gradients and optimizer state (this rank's shards)
  plus the peak of everything the step allocated (scratch included).

The debug model is changed only where the long sequence needs it: RoPE
tables sized to ``--seq-len`` (the flavor stops at 4096) and ``--layers``
decoder layers (the flavor's 8; 4 keep one window pattern).

    python benchmarks/memory_per_rank.py                  # table + JSON
    python benchmarks/memory_per_rank.py --seq-len 512 --cp 1 2 --images 1 4
"""

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "outputs" / "benchmarks" / "memory_per_rank.json"
MIB = 2**20


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--images", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens-per-image", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cp[0] != 1:
        parser.error(
            f"--cp must start with 1 (the baseline of the ratios); got {args.cp}"
        )
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


# ---------------------------------------------------------------- worker side


def _job_args(args: argparse.Namespace, cp: int, dump: str) -> list[str]:
    return [
        *("--module", "torchtitan_ext.muse_glimmer"),
        *("--config", "muse_glimmer_debugmodel_mm_packed"),
        *("--parallelism.context_parallel_degree", str(cp)),
        *("--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", "1"),
        # FSDP (every CP > 1 job) would compute in bf16, CP1 in fp32.
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


def _batch(trainer, seq_len: int, images: int, tokens_per_image: int):
    """One row: text, with ``images`` evenly spaced placeholder spans."""
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


def _state_bytes(trainer) -> dict[str, int]:
    def nbytes(tensors) -> int:
        storages = {}
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storages[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
        return sum(storages.values())

    params = [p for m in trainer.model_parts for p in m.parameters()]
    states = [
        v
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return {
        "params": nbytes(params),
        "grads": nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer": nbytes(states),
    }


def _measure_step(trainer, batch, vision_modules) -> dict:
    from _live_memory import LiveMemory
    from torchtitan.tools.utils import device_module

    from torchtitan_ext import cpu_backend

    tracker = LiveMemory(vision_modules)
    fwd_bwd = trainer.forward_backward_step
    # CP sharding compiles create_block_mask, which no dispatch mode may watch:
    # the step's inputs are prepared (by the real hook) before it starts.
    prepared = trainer.post_dataloading_process(*batch)

    peak_rss = {}

    def fwd_bwd_as_forward(**kwargs):
        with tracker.in_phase("forward"):
            loss = fwd_bwd(**kwargs)
        # Read before the metrics logger resets the peak after the step.
        peak_rss["fwd_bwd"] = cpu_backend.peak_rss_bytes()
        return loss

    trainer.post_dataloading_process = lambda input_dict, labels: prepared
    trainer.forward_backward_step = fwd_bwd_as_forward
    trainer.step += 1
    device_module.reset_peak_memory_stats()
    try:
        with tracker, tracker.in_phase("step"):
            trainer.train_step(trainer.batch_generator([batch]))
    finally:
        del trainer.post_dataloading_process, trainer.forward_backward_step
        tracker.remove_hooks()
    peak = dict(tracker.peak)
    scratch = {
        region: max(
            peak.get(f"{phase}/{region}/attn_scratch", 0)
            for phase in ("forward", "backward")
        )
        for region in ("decoder", "vision")
    }
    return {
        "decoder_activation_bytes": peak.get("forward/decoder", 0),
        "vision_activation_bytes": peak.get("forward/vision", 0),
        "decoder_attn_scratch_bytes": scratch["decoder"],
        "vision_attn_scratch_bytes": scratch["vision"],
        "backward_peak_bytes": {
            k: v for k, v in peak.items() if k.startswith("backward/")
        },
        "step_allocated_peak_bytes": tracker.peak_total,
        "at_step_peak_bytes": tracker.at_peak,
        "state_bytes": _state_bytes(trainer),
        "peak_rss_bytes": peak_rss["fwd_bwd"],
    }


def _worker(args: argparse.Namespace) -> None:
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    from torchtitan.config import ConfigManager

    from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS

    with tempfile.TemporaryDirectory() as dump:
        config = ConfigManager().parse_args(_job_args(args, world, dump))
        _fit_model(config.model_spec.model, args.seq_len, args.layers)
        trainer = config.build()
        try:
            model = trainer.model_parts[0]
            vision_modules = [getattr(model, fqn) for fqn in VISION_MODULE_FQNS]
            # One-time allocations (FSDP lazy init, optimizer state) stay out.
            warm_up = _batch(trainer, min(args.seq_len, 1024), 1, args.tokens_per_image)
            _measure_step(trainer, warm_up, vision_modules)
            rows = []
            for images in args.images:
                batch = _batch(trainer, args.seq_len, images, args.tokens_per_image)
                rows.append(
                    {"images": images, **_measure_step(trainer, batch, vision_modules)}
                )
        finally:
            trainer.close()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, rows)
    if int(os.environ["RANK"]) == 0:
        args.worker_out.write_text(json.dumps(gathered))
    # As torchtitan.train's main: a process group left to interpreter exit can
    # abort there ("terminate called without an active exception"; seen once).
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- driver side


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_cp(args: argparse.Namespace, cp: int, out: Path) -> list[list[dict]]:
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--nproc_per_node", str(cp)),
        *("--master_addr", "127.0.0.1", "--master_port", str(_free_port())),
        __file__,
        *(
            "--seq-len",
            str(args.seq_len),
            "--tokens-per-image",
            str(args.tokens_per_image),
        ),
        *("--layers", str(args.layers), "--images", *map(str, args.images)),
        *("--cp", "1", "--worker-out", str(out)),
    ]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s
    )
    if run.returncode != 0:
        raise RuntimeError(
            f"CP{cp} run failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


def _rows(args, per_cp: dict[int, list[list[dict]]]) -> list[dict]:
    rows = []
    for cp, ranks in per_cp.items():
        for i, images in enumerate(args.images):
            rank_rows = [rank[i] for rank in ranks]
            worst = max(rank_rows, key=lambda r: r["decoder_activation_bytes"])
            state = worst["state_bytes"]
            rows.append(
                {
                    "cp": cp,
                    "images": images,
                    "vision_tokens": images * args.tokens_per_image,
                    "decoder_activation_mib": worst["decoder_activation_bytes"] / MIB,
                    "vision_activation_mib": max(
                        r["vision_activation_bytes"] for r in rank_rows
                    )
                    / MIB,
                    "decoder_attn_scratch_mib": max(
                        r["decoder_attn_scratch_bytes"] for r in rank_rows
                    )
                    / MIB,
                    "vision_attn_scratch_mib": max(
                        r["vision_attn_scratch_bytes"] for r in rank_rows
                    )
                    / MIB,
                    "state_mib": sum(state.values()) / MIB,
                    "step_peak_mib": max(
                        r["step_allocated_peak_bytes"]
                        + r["state_bytes"]["params"]
                        + r["state_bytes"]["optimizer"]
                        for r in rank_rows
                    )
                    / MIB,
                    "peak_rss_mib": max(r["peak_rss_bytes"] for r in rank_rows) / MIB,
                    "ranks": rank_rows,
                }
            )
    base = {r["images"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        b = base[r["images"]]
        r["decoder_ratio_vs_cp1"] = (
            r["decoder_activation_mib"] / b["decoder_activation_mib"]
        )
        r["vision_ratio_vs_cp1"] = (
            r["vision_activation_mib"] / b["vision_activation_mib"]
        )
        r["vision_share"] = r["vision_activation_mib"] / (
            r["vision_activation_mib"] + r["decoder_activation_mib"]
        )
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "| CP | images | vision tokens | decoder act. MiB | vs CP1 | vision act. MiB | "
        "vs CP1 | vision share | attn scratch MiB (dec / vis) | params+grads+opt MiB | "
        "step peak MiB | peak RSS MiB |",
        "|" + " ---: |" * 12,
    ]
    for r in sorted(rows, key=lambda r: (r["images"], r["cp"])):
        lines.append(
            f"| {r['cp']} | {r['images']} | {r['vision_tokens']} | "
            f"{r['decoder_activation_mib']:.1f} | {r['decoder_ratio_vs_cp1']:.2f}x | "
            f"{r['vision_activation_mib']:.1f} | {r['vision_ratio_vs_cp1']:.2f}x | "
            f"{100 * r['vision_share']:.0f}% | "
            f"{r['decoder_attn_scratch_mib']:.0f} / "
            f"{r['vision_attn_scratch_mib']:.0f} | {r['state_mib']:.1f} | "
            f"{r['step_peak_mib']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.worker_out is not None:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        per_cp = {cp: _run_cp(args, cp, Path(tmp) / f"cp{cp}.json") for cp in args.cp}
    rows = _rows(args, per_cp)
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker_out")}
    args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
