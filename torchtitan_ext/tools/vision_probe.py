"""Does a trained muse_glimmer read its images? Caption loss, true vs shuffled images.

``python -m torchtitan_ext.tools.vision_probe --checkpoint DIR`` probes one
checkpoint; ``--out DIR [--seeds ...] [--jobs ...]`` trains and probes runs over
seeds (README: "Vision probe over seeds"); runs already in ``DIR`` are not retrained.

The embedded captions are a function of the image (``torchtitan_ext.embedded_data``),
so a model that learned the vision path predicts caption tokens much better with the
sample's own image than with another sample's. The probe loads a DCP checkpoint's
model keys into the plug-in model (one CPU process, fp32) and scores N batches of the
job's own ``MMDataLoader`` twice: as they are, and with the images moved along one
random cycle among those of equal ``grid_thw`` (so the placeholder counts stay
valid). ``--heldout-seed S`` scores freshly generated images no run has seen: the
gap then shows that the model reads images rather than recognising memorised
samples; a run has learned when that gap exceeds ``--margin``."""

import argparse
import itertools
import json
import math
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HELDOUT_SEED",
    "LEARNED_MARGIN",
    "PROBE_LR",
    "ProbeResult",
    "build_probe_job",
    "format_result",
    "probe_batches",
    "probe_training_args",
    "run_probe",
    "shuffle_images",
]

IGNORE_INDEX = -100
# The embedded generator's seed for images no training run has seen.
HELDOUT_SEED = 9876
# A run has learned the vision path when its held-out gap exceeds this: half
# the smallest gap of the fp32 runs (CP2, 0.091).
LEARNED_MARGIN = 0.045
# At 8e-3 the fp32 CP2 run of seed 42 learned on an AMD EPYC and collapsed on
# an Intel Xeon (every image encoded alike; so did the run before the #4244
# backport); 4e-3 and 2e-3 learned there (held-out gaps 0.092, 0.085).
PROBE_LR = "2e-3"

_Batch = tuple[dict[str, Any], Any]


@dataclass(frozen=True)
class ProbeResult:
    """Mean caption-token cross-entropy (nats) with true and shuffled images."""

    checkpoint: str
    dataset: str  # "embedded" or "heldout-seed-<S>"
    true_loss: float
    shuffled_loss: float
    difference: float  # shuffled_loss - true_loss
    n_tokens: int  # caption tokens scored in each pass
    n_samples: int
    n_images: int
    moved_fraction: float  # images that went to another sample
    batches: int
    batch_size: int
    seq_len: int
    seed: int


def _job_args(seed: int, flags: str) -> list[str]:
    # One 256-token row per rank (FSDP2 and FSDP2 x CP2 see the same global batch).
    return shlex.split(
        "--training.seq_len 256 --training.local_batch_size 1 "
        f"--debug.deterministic --debug.seed={seed} {flags}"
    )


def probe_training_args(
    *, steps: int, seed_checkpoint: str | Path, fp32: bool, seed: int = 42
) -> list[str]:
    """``run_train.sh`` flags training from ``seed_checkpoint`` to a model-only fp32
    checkpoint at ``steps``; ``fp32`` keeps FSDP's parameters in float32 (as the
    parity suites do) instead of the job's default bf16 mixed precision."""
    precision = "--training.mixed_precision_param float32" if fp32 else ""
    return _job_args(
        seed,
        f"{precision} --training.steps {steps} "
        f"--optimizer.param-groups.0.optimizer-kwargs.lr {PROBE_LR} "
        "--lr_scheduler.warmup_steps 5 --training.max_norm 1.0 "
        f"--checkpoint.enable --checkpoint.interval {steps} "
        "--checkpoint.last_save_model_only --checkpoint.export_dtype float32 "
        f"--checkpoint.initial_load_path={shlex.quote(str(seed_checkpoint))} "
        "--checkpoint.initial_load_model_only activation-checkpoint:none",
    )


def build_probe_job(*, seq_len: int):
    """The plug-in's ``muse_glimmer_debugmodel_mm`` job (1 rank), after
    ``cpu_backend.apply()``. Rows are not packed, and padding cannot change a
    token's loss (causal, per-document masks): ``seq_len`` 64 holds the longest
    sample (~30 tokens) and gives bitwise the jobs' 256's losses, 4x faster."""
    from torchtitan_ext.muse_glimmer import config_registry

    job = config_registry.muse_glimmer_debugmodel_mm()
    job.training.seq_len = seq_len
    return job


def probe_batches(job, n: int, *, batch_size: int) -> list[_Batch]:
    """The first ``n`` batches of torchtitan's ``MMDataLoader`` from the job's
    dataloader config, 1 DP rank: a fresh loader, the dataset in file order."""
    if batch_size > job.dataloader.max_images_per_batch:
        raise ValueError(
            f"batch_size={batch_size} exceeds the job's max_images_per_batch="
            f"{job.dataloader.max_images_per_batch}: the collator would drop samples"
        )
    from torchtitan_ext.embedded_data import ensure_embedded_assets

    ensure_embedded_assets()  # the debug jobs' data, as the launcher makes it
    dataloader = job.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=job.tokenizer.build(tokenizer_path=job.hf_assets_path),
        seq_len=job.training.seq_len,
        local_batch_size=batch_size,
    )
    batches = list(itertools.islice(dataloader, n))
    if len(batches) < n:
        raise RuntimeError(f"the dataloader ended after {len(batches)} of {n} batches")
    return batches


def shuffle_images(
    batches: list[_Batch], *, seed: int = 0
) -> tuple[list[_Batch], float, int]:
    """(batches with images permuted among equal grids, fraction moved, images).

    Pixel rows are padded per batch: a moved image fills as many patches in its new
    row, and the padding stays as the collator left it."""
    import torch

    slots: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    new_pixels = []
    for b, (inputs, _) in enumerate(batches):
        pixels = inputs.get("pixel_values")
        new_pixels.append(None if pixels is None else pixels.clone())
        if pixels is not None:
            for i, thw in enumerate(inputs["grid_thw"].tolist()):
                slots.setdefault(tuple(thw), []).append((b, i))

    generator = torch.Generator().manual_seed(seed)
    n_images = moved = 0
    for thw, group in sorted(slots.items()):
        n_images += len(group)
        if len(group) < 2:
            continue
        # One random cycle through the group: every image leaves its sample.
        order = torch.randperm(len(group), generator=generator).tolist()
        n_patches = math.prod(thw)
        for k, dst in enumerate(order):
            (db, di), (sb, si) = group[dst], group[order[(k + 1) % len(order)]]
            source = batches[sb][0]["pixel_values"][si, :n_patches]
            new_pixels[db][di, :n_patches] = source
            moved += (db, di) != (sb, si)

    shuffled = [
        ({**inputs, "pixel_values": pixels}, labels)
        for (inputs, labels), pixels in zip(batches, new_pixels, strict=True)
    ]
    return shuffled, (moved / n_images if n_images else 0.0), n_images


def caption_loss(model, batches: list[_Batch]) -> float:
    """Summed fp32 cross-entropy over labels != -100 (the caption tokens).

    Inputs as the plug-in Trainer builds them (no CP); the jobs' ``spmd_types`` backend
    needs a device mesh, ``partial_dtensor`` computes the same without."""
    import torch
    import torch.nn.functional as F

    from torchtitan_ext.muse_glimmer import build_vision_bank_indices
    from torchtitan_ext.muse_glimmer.batch_agreement import SAMPLE_DIGESTS
    from torchtitan_ext.tools.simulated_cluster import spmd_backend

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad(), spmd_backend("partial_dtensor"):
        for inputs, labels in batches:
            # The loader's sample digests are for the batch check, not the model.
            kwargs = {
                k: v for k, v in inputs.items() if k not in ("input", SAMPLE_DIGESTS)
            }
            kwargs["attention_masks"] = model.get_attention_masks(inputs["positions"])
            if inputs.get("pixel_values") is not None:
                kwargs["vision_bank_indices"] = build_vision_bank_indices(
                    inputs["input"],
                    inputs["grid_thw"],
                    image_id=inputs["special_tokens"]["image_id"],
                    spatial_merge_size=model.config.vision_encoder.downsample_factor,
                )
            logits = model(inputs["input"], **kwargs).float().flatten(0, 1)
            # ignore_index is -100 by default, as the collator's IGNORE_INDEX.
            total += F.cross_entropy(logits, labels.flatten(), reduction="sum").double()
    return float(total)


def run_probe(
    checkpoint: str | Path,
    *,
    batches: int = 8,
    batch_size: int = 8,
    seq_len: int = 64,
    seed: int = 0,
    heldout_seed: int | None = None,
) -> ProbeResult:
    """Load ``checkpoint``; score ``batches`` batches with true and shuffled images."""
    if not (Path(checkpoint) / ".metadata").is_file():
        raise FileNotFoundError(
            f"{checkpoint} is not a DCP checkpoint (no .metadata); pass the "
            "step folder, e.g. <dump_folder>/checkpoint/step-N"
        )
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext import cpu_backend
    from torchtitan_ext.embedded_data import EmbeddedDataConfig, ensure_embedded_assets

    cpu_backend.apply()
    job = build_probe_job(seq_len=seq_len)
    # fp32, the default dtype: ``.to`` would drop RoPE's complex cache.
    model_config = job.model_spec.model
    model_config.update_from_config(config=job)
    model = model_config.build().eval()
    state_dict = model.state_dict()
    dcp.load(state_dict, checkpoint_id=str(checkpoint))  # names a missing key
    model.load_state_dict(state_dict, strict=True)
    dataset = "embedded" if heldout_seed is None else f"heldout-seed-{heldout_seed}"
    with tempfile.TemporaryDirectory(prefix="vision-probe-") as tmp:
        if heldout_seed is not None:
            n = batches * batch_size
            config = EmbeddedDataConfig(seed=heldout_seed, num_samples=n, num_shards=1)
            assets = ensure_embedded_assets(Path(tmp) / "heldout", config=config)
            job.dataloader.dataset_path = str(assets.dataset_dir)
        data = probe_batches(job, batches, batch_size=batch_size)
    shuffled, moved_fraction, n_images = shuffle_images(data, seed=seed)
    # The shuffled batches keep the labels: one token count for both passes.
    n_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in data)
    true_loss = caption_loss(model, data) / n_tokens
    shuffled_loss = caption_loss(model, shuffled) / n_tokens
    return ProbeResult(
        checkpoint=str(checkpoint),
        dataset=dataset,
        true_loss=true_loss,
        shuffled_loss=shuffled_loss,
        difference=shuffled_loss - true_loss,
        n_tokens=n_tokens,
        n_samples=sum(int((y != IGNORE_INDEX).any(dim=1).sum()) for _, y in data),
        n_images=n_images,
        moved_fraction=moved_fraction,
        batches=batches,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
    )


def format_result(result: ProbeResult) -> str:
    rows = {
        "true images": f"{result.true_loss:.4f}",
        "shuffled images": f"{result.shuffled_loss:.4f}",
        "difference": f"{result.difference:+.4f}",
        "caption tokens": result.n_tokens,
        "samples / images": f"{result.n_samples} / {result.n_images}",
        "images moved": f"{result.moved_fraction:.1%}",
    }
    lines = [f"  {name:<16}  {value}" for name, value in rows.items()]
    return "\n".join([f"vision probe: {result.checkpoint} ({result.dataset})", *lines])


_SHARDED = " --parallelism.context_parallel_vision sharded"
# Job name: its TOML file, then extra flags (the ranks follow from both).
_JOBS = {
    "fsdp2": "fsdp2.toml",
    "fsdp2_cp2": "fsdp2_cp2.toml",
    "fsdp2_cp2_sharded_vision": "fsdp2_cp2.toml" + _SHARDED,
    "cp2": "cp2.toml",
    "cp2_sharded_vision": "cp2.toml" + _SHARDED,
    "packed": "packed.toml",
    # Reorder controls for FSDP2 x CP2: the same global batch, other rounding.
    "fsdp2_tp2_sp": "fsdp2.toml --parallelism.tensor_parallel_degree 2",
    "fsdp2_cp2_headtail": "fsdp2_cp2.toml --parallelism.context_parallel_load_balancer"
    " headtail",
}
_HEADER = (
    f"seed | {'job':<24} | true emb | shuf emb | gap emb | true held "
    "| shuf held | gap held | learned"
)


def _trained(out: Path, name: str, job: str, args: list[str], step: int) -> Path:
    """The run's checkpoint at ``step``, trained unless ``out`` holds it."""
    from torchtitan_ext.tools.parity import launch

    checkpoint = out / name / "checkpoint" / f"step-{step}"
    if not (checkpoint / ".metadata").is_file():
        toml, _, options = _JOBS[job].partition(" ")
        toml = str(launch.REPO_ROOT / "train_configs" / toml)
        spec = launch.RunSpec(config_file=toml, options=options)
        argv = [str(launch.RUN_TRAIN), f"--dump_folder={out / name}"]
        argv += [*spec.option_args(), *args]
        log = out / f"{name}.log"
        record = launch.launch_run(
            name, spec.job_env(), argv, log, timeout=3600, echo=False
        )
        if not record.ok:
            raise RuntimeError(record.failure())
    return checkpoint


def _format_row(row: dict) -> str:
    e, h = row["embedded"], row["heldout"]
    return (
        f"{row['seed']:>4} | {row['job']:<24} | {e['true_loss']:8.4f} | "
        f"{e['shuffled_loss']:8.4f} | {e['difference']:+7.4f} | "
        f"{h['true_loss']:9.4f} | {h['shuffled_loss']:9.4f} | "
        f"{h['difference']:+8.4f} | {'yes' if row['learned'] else 'no'}"
    )


def _probe_seeds(args: argparse.Namespace, probe: dict[str, Any]) -> dict:
    """Per seed: a seed checkpoint (1 rank, packed TOML), each job trained from it
    and probed on the embedded and on held-out images; the report of all runs."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()  # before RunSpec reads a TOML job, which imports torchtitan
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    heldout_seed = HELDOUT_SEED if args.heldout_seed is None else args.heldout_seed
    rows = []
    for seed in args.seeds:
        create = "--checkpoint.enable --checkpoint.create_seed_checkpoint"
        initial = _trained(out, f"seed{seed}", "packed", _job_args(seed, create), 0)
        train_args = probe_training_args(
            steps=args.steps, seed_checkpoint=initial, fp32=args.fp32, seed=seed
        )
        for job in args.jobs:
            checkpoint = _trained(out, f"{job}_seed{seed}", job, train_args, args.steps)
            embedded = asdict(run_probe(checkpoint, **probe))
            heldout = asdict(run_probe(checkpoint, heldout_seed=heldout_seed, **probe))
            learned = heldout["difference"] > args.margin
            rows.append(dict(seed=seed, job=job, learned=learned, embedded=embedded))
            rows[-1]["heldout"] = heldout
            print(_format_row(rows[-1]), flush=True)
    print("\n".join([_HEADER, *map(_format_row, rows)]))
    summary = {j: sum(r["learned"] for r in rows if r["job"] == j) for j in args.jobs}
    for job, learned in summary.items():
        print(f"{job}: learned the vision path in {learned} of {len(args.seeds)} seeds")
    return {
        "steps": args.steps,
        "precision": "float32" if args.fp32 else "bf16 (job default)",
        "margin": args.margin,
        "runs": rows,
        "learned": summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.vision_probe",
        description="Caption-token loss of a muse_glimmer checkpoint with true "
        "vs shuffled images (CPU, one process), or of runs trained over seeds.",
    )
    mode = parser.add_mutually_exclusive_group(required=True).add_argument
    mode("--checkpoint", help="DCP folder, e.g. <dump>/checkpoint/step-N")
    mode("--out", type=Path, help="train over seeds: runs, logs, probe_seeds.json")
    add = parser.add_argument
    add("--batches", type=int, default=8, help="batches to score")
    add("--batch-size", type=int, default=8, help="samples per batch (at most 8)")
    add("--seq-len", type=int, default=64, help="row length (longest sample ~30)")
    add("--seed", type=int, default=0, help="shuffle generator seed")
    add("--heldout-seed", type=int, help="score fresh images of this generator seed")
    add("--json", type=Path, help="write the result here (--out: DIR/probe_seeds.json)")
    add = parser.add_argument_group("over seeds (with --out)").add_argument
    add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    add("--jobs", nargs="+", choices=sorted(_JOBS), default=["fsdp2", "fsdp2_cp2"])
    add("--steps", type=int, default=150)
    add("--fp32", action="store_true", help="float32, not bf16")
    add("--margin", type=float, default=LEARNED_MARGIN, help="held-out gap to learn")
    args = parser.parse_args(argv)
    probe = {k: vars(args)[k] for k in ("batches", "batch_size", "seq_len", "seed")}
    if args.out is not None:
        report = _probe_seeds(args, probe)
        json_path = args.json or args.out.resolve() / "probe_seeds.json"
    else:
        result = run_probe(args.checkpoint, heldout_seed=args.heldout_seed, **probe)
        print(format_result(result))
        report, json_path = asdict(result), args.json
        print(json.dumps(report, indent=2))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
