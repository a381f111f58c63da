"""Peak tensor memory per rank of one training step, CP1 vs CP2 vs CP4, by vision mode.

Each ``--cp`` degree runs on its own ranks (``_harness.run_degrees``), one
``train_step`` per row and ``--vision`` mode (at CP1 the modes coincide:
measured once); ratios against CP1. Allocated tensor storage, not RSS
(``_live_memory.LiveMemory``), by phase and region: activations are the
forward's peak without attention scratch (the eager CPU flex kernel's
[B, H, Lq, Lk] scores, which a fused GPU kernel never stores); step peak adds
parameters and optimizer state; the sharded exchange's bytes per rank
(``_vision_modes.ExchangeBytes``) stand beside the bytes it saves (it runs
outside the vision modules: its blocks count as decoder activations).
``--planned`` plans the measured rows (``--json``, its settings) with
``torchtitan_ext.tools.estimate`` and prints both, with their ratios.

    python benchmarks/memory_per_rank.py                  # table + JSON
    python benchmarks/memory_per_rank.py --seq-len 512 --cp 1 2 --images 1 4
    python benchmarks/memory_per_rank.py --planned        # planner vs measured
"""

import argparse
import json
import sys
import time
from unittest import mock

import _harness  # benchmarks/, first on sys.path when run as a script
import torch
from _harness import MIB
from _vision_modes import ExchangeBytes, modes_at, with_vision_share


def _parse_args(argv=None) -> argparse.Namespace:
    row = dict(seq_len=8192, images=[1, 16, 64], json="memory_per_rank.json")
    parser = _harness.degree_parser(__doc__, cp=[1, 2, 4], **row)
    parser.add_argument("--planned", action="store_true", help="plan --json's rows")
    if "--planned" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(cp=None, images=None)  # every measured row
        return parser.parse_args(argv)
    args = _harness.parse_row(parser, argv)
    if args.cp[0] != 1:
        parser.error(f"--cp must start with 1 (the ratios' baseline); got {args.cp}")
    return args


def _state_bytes(trainer) -> dict[str, int]:
    from _live_memory import storage_bytes

    params = [p for m in trainer.model_parts for p in m.parameters()]
    states = [
        v
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": storage_bytes(states),
    }


def _measure_step(trainer, mode: str, batch, vision_modules) -> dict:
    from _live_memory import LiveMemory
    from torchtitan.tools.utils import device_module

    from torchtitan_ext import cpu_backend

    tracker = LiveMemory(vision_modules)
    fwd_bwd = trainer.forward_backward_step
    batch = with_vision_share(trainer, batch, mode)
    # CP sharding compiles create_block_mask, which no dispatch mode may watch:
    # the step's inputs are prepared (by the real hook) before it starts.
    prepared = trainer.post_dataloading_process(*batch)

    peak_rss = {}

    def fwd_bwd_as_forward(**kwargs):
        with mock.patch.object(tracker, "phase", "forward"):
            loss = fwd_bwd(**kwargs)
        # Read before the metrics logger resets the peak after the step.
        peak_rss["fwd_bwd"] = cpu_backend.peak_rss_bytes()
        return loss

    trainer.post_dataloading_process = lambda input_dict, labels: prepared
    trainer.forward_backward_step = fwd_bwd_as_forward
    trainer.step += 1
    device_module.reset_peak_memory_stats()
    try:
        with tracker, ExchangeBytes() as exchange:
            trainer.train_step(iter([batch]))
    finally:
        del trainer.post_dataloading_process, trainer.forward_backward_step
        tracker.remove_hooks()
    peak = dict(tracker.peak)
    return {
        "decoder_activation_bytes": peak.get("forward/decoder", 0),
        "vision_activation_bytes": peak.get("forward/vision", 0),
        **{
            f"{region}_attn_scratch_bytes": max(
                peak.get(f"{phase}/{region}/attn_scratch", 0)
                for phase in ("forward", "backward")
            )
            for region in ("decoder", "vision")
        },
        "step_allocated_peak_bytes": tracker.peak_total,
        "state_bytes": _state_bytes(trainer),
        "peak_rss_bytes": peak_rss["fwd_bwd"],
        **exchange.summary(),
    }


def _measure(args: argparse.Namespace, trainer) -> list[dict]:
    """Rows per (images, mode); at CP1 one measurement stands for every mode."""
    from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS

    model = trainer.model_parts[0]
    vision_modules = [getattr(model, fqn) for fqn in VISION_MODULE_FQNS]
    modes = modes_at(trainer, args.vision)
    # One-time allocations (FSDP lazy init, optimizer state) stay out.
    warm_up = _harness.row_batch(args, trainer, 1, min(args.seq_len, 1024))
    for mode in modes:
        _measure_step(trainer, mode, warm_up, vision_modules)
    rows = []
    for images in args.images:
        batch = _harness.row_batch(args, trainer, images)
        measured = {m: _measure_step(trainer, m, batch, vision_modules) for m in modes}
        for mode in args.vision:
            row = measured.get(mode, measured[modes[0]])
            rows.append({"images": images, "vision": mode, **row})
    return rows


# Rank figures reported (in MiB) on the rank where each is largest.
_MOST = ("decoder_activation", "vision_activation", "decoder_attn_scratch")
_MOST += ("vision_attn_scratch", "peak_rss")
_MOST += ("exchange_forward", "exchange_backward", "exchange_wire")


def _row(args, rank_rows: list[dict]) -> dict:
    """One (CP, images, mode): each figure on the rank where it is largest."""

    def most_mib(value) -> float:
        return max(map(value, rank_rows)) / MIB

    return {
        "vision": rank_rows[0]["vision"],
        **{f"{k}_mib": most_mib(lambda r, k=k: r[f"{k}_bytes"]) for k in _MOST},
        "total_activation_mib": most_mib(
            lambda r: r["decoder_activation_bytes"] + r["vision_activation_bytes"]
        ),
        "step_peak_mib": most_mib(
            lambda r: (
                r["step_allocated_peak_bytes"]
                + r["state_bytes"]["params"]
                + r["state_bytes"]["optimizer"]
            )
        ),
        "ranks": rank_rows,
    }


_COLUMNS = [
    *(("CP", "{cp}"), ("images", "{images}"), ("vision", "{vision}")),
    ("vision tokens", "{vision_tokens}"),
    *(
        column
        for name in ("decoder", "vision", "total")
        for column in (
            (f"{name} act. MiB", f"{{{name}_activation_mib:.1f}}"),
            ("vs CP1", f"{{{name}_ratio_vs_cp1:.2f}}x"),
        )
    ),
    (
        "attn scratch MiB (dec / vis)",
        "{decoder_attn_scratch_mib:.0f} / {vision_attn_scratch_mib:.0f}",
    ),
    ("step peak MiB", "{step_peak_mib:.0f}"),
    ("peak RSS MiB", "{peak_rss_mib:.0f}"),
]
# Sharded mode under CP: what the exchange moves beside what it saves.
_EXCHANGE_COLUMNS = [
    *(("CP", "{cp}"), ("images", "{images}")),
    ("all-gather out MiB (fwd)", "{exchange_forward_mib:.2f}"),
    ("reduce-scatter in MiB (bwd, fp32)", "{exchange_backward_mib:.2f}"),
    ("ring MiB sent per rank", "{exchange_wire_mib:.2f}"),
    ("vision act. saved MiB per rank", "{vision_saved_mib:.2f}"),
]


def _report(args, rows: list[dict]) -> str:
    """The tables; each row gains its ratios to CP1 and what sharding saves."""
    by_key = {(r["cp"], r["images"], r["vision"]): r for r in rows}
    for r in rows:
        b = by_key[1, r["images"], r["vision"]]
        for name in ("decoder", "vision", "total"):
            key = f"{name}_activation_mib"
            r[f"{name}_ratio_vs_cp1"] = r[key] / b[key]
        rep = by_key.get((r["cp"], r["images"], "replicated"))
        if r["vision"] == "sharded" and rep is not None:
            key = "vision_activation_mib"
            r["vision_saved_mib"] = rep[key] - r[key]
    order = sorted(rows, key=lambda r: (r["images"], r["vision"], r["cp"]))
    text = _harness.table(_COLUMNS, order, left=["vision"])
    if "sharded" not in args.vision or "replicated" not in args.vision:
        return text
    sharded = [r for r in order if r["cp"] > 1 and "vision_saved_mib" in r]
    text += "\n\nSharded vision: bytes exchanged vs activation bytes saved, per rank\n"
    return text + _harness.table(_EXCHANGE_COLUMNS, sharded)


# Each compared figure, from a measured rank (JSON) and from a planned one.
_MEASURED = {
    "decoder": lambda r: r["decoder_activation_bytes"],
    "vision": lambda r: r["vision_activation_bytes"],
    "state": lambda r: sum(r["state_bytes"].values()),
}
_PLANNED = {
    "decoder": lambda e: e.decoder_activations,
    "vision": lambda e: e.vision_activations,
    "state": lambda e: e.parameters + e.gradients + e.optimizer,
}
_TITLES = ("decoder act.", "vision act.", "params+grads+opt")
_PLAN_COLUMNS = [("CP", "{cp}"), ("images", "{images}"), ("vision", "{vision}")]
for _kind, _title in zip(_PLANNED, _TITLES, strict=True):
    _PLAN_COLUMNS.append((f"{_title} MiB planned", f"{{planned_mib[{_kind}]:.1f}}"))
    _PLAN_COLUMNS.append(("measured", f"{{measured_mib[{_kind}]:.1f}}"))
    _PLAN_COLUMNS.append(("ratio", f"{{ratio[{_kind}]:.3f}}"))


def _compare(settings: argparse.Namespace, measured_row: dict) -> dict:
    """A measured row beside the planner's estimates of every simulated rank."""
    from torchtitan_ext.tools.estimate.cli import plan_job

    row = {k: measured_row[k] for k in ("cp", "images", "vision")}
    cp, images, vision = row.values()
    job = _harness.degree_job(settings, cp, dump=str(_harness.OUTPUTS.parent))
    job += ["--parallelism.context_parallel_vision", vision]
    config = _harness.load_config(job, settings.layers)
    tokens = settings.tokens_per_image
    plan = plan_job(config, images=images, tokens_per_image=tokens, world_size=cp)
    measured = {k: max(map(f, measured_row["ranks"])) for k, f in _MEASURED.items()}
    planned = {k: max(map(f, plan[2])) for k, f in _PLANNED.items()}
    return {
        **row,
        "planned_mib": {k: v / MIB for k, v in planned.items()},
        "measured_mib": {k: v / MIB for k, v in measured.items()},
        "ratio": {k: planned[k] / measured[k] for k in planned},
    }


def _planned(args) -> None:
    """Each measured row beside the planner's, on the rank where each is largest."""
    measured = json.loads(args.json.read_text())
    settings = argparse.Namespace(**measured["settings"])
    cps, images = args.cp or settings.cp, args.images or settings.images
    rows, start = [], time.perf_counter()
    for row in measured["rows"]:
        if row["cp"] not in cps or row["images"] not in images:
            continue
        if row["cp"] == 1 and row["vision"] == "sharded":
            continue  # CP1 runs the replicated path in both modes
        rows.append(_compare(settings, row))
    print(
        f"Planner vs measured ({args.json.name}): seq_len {settings.seq_len}, "
        f"{settings.tokens_per_image} tokens per image, {settings.layers} decoder "
        "layers; each figure on the rank where it is largest; activations without "
        "the eager attention kernel's scratch (measured) / flex attention's fake "
        "kernel (planned).\n"
    )
    print(_harness.table(_PLAN_COLUMNS, rows, left=["vision"]))
    print(f"\nplanned in {time.perf_counter() - start:.0f} s")
    out = args.json.with_name(f"{args.json.stem}_planned.json")
    _harness.write_json(out, {"measured": str(args.json), "rows": rows})


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.planned:
        _planned(args)
    else:
        _harness.run_degrees(args, _measure, _row, _report)


if __name__ == "__main__":
    main()
