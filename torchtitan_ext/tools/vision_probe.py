"""Does a trained muse_glimmer read its images? Caption loss, true vs shuffled images.

``python -m torchtitan_ext.tools.vision_probe --checkpoint DIR [--batches N]
[--heldout-seed S] [--json PATH]``

The embedded captions are a function of the image (``torchtitan_ext.embedded_data``),
so a model that learned the vision path predicts caption tokens much better with
the sample's own image than with another sample's. The probe loads a DCP
checkpoint's model keys into the plug-in model (one CPU process, fp32) and scores
N batches of the job's own ``MMDataLoader`` twice: as they are, and with the
images moved along one random cycle among those of equal ``grid_thw`` (so the
placeholder counts stay valid). ``--heldout-seed S`` scores freshly generated
images no run has seen: the gap then shows that the model reads images rather
than recognising memorised samples.
"""

from __future__ import annotations

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
    "build_probe_dataloader",
    "build_probe_job",
    "format_result",
    "probe_training_args",
    "run_probe",
    "seed_checkpoint_args",
    "shuffle_images",
    "take_batches",
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


def seed_checkpoint_args(seed: int = 42) -> list[str]:
    """``run_train.sh`` flags (1 rank, packed TOML) writing the initial weights."""
    return _job_args(seed, "--checkpoint.enable --checkpoint.create_seed_checkpoint")


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


def build_probe_job(*, seq_len: int, dataset_path: str | Path | None = None):
    """The plug-in's ``muse_glimmer_debugmodel_mm`` job (1 rank), after
    ``cpu_backend.apply()``. Rows are not packed, and padding cannot change a
    token's loss (causal, per-document masks): ``seq_len`` 64 holds the longest
    sample (~30 tokens) and gives bitwise the jobs' 256's losses, 4x faster."""
    from torchtitan_ext.muse_glimmer import config_registry

    job = config_registry.muse_glimmer_debugmodel_mm()
    job.training.seq_len = seq_len
    if dataset_path is not None:
        job.dataloader.dataset_path = str(dataset_path)
    return job


def load_probe_model(job, checkpoint: str | Path):
    """The job's model in fp32 (the default dtype; ``.to`` would drop RoPE's
    complex cache), weights from the model keys of a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    model_config = job.model_spec.model
    model_config.update_from_config(config=job)
    model = model_config.build()
    state_dict = model.state_dict()
    dcp.load(state_dict, checkpoint_id=str(checkpoint))  # names a missing key
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def build_probe_dataloader(job, *, batch_size: int):
    """torchtitan's ``MMDataLoader`` from the job's dataloader config, 1 DP rank."""
    if batch_size > job.dataloader.max_images_per_batch:
        raise ValueError(
            f"batch_size={batch_size} exceeds the job's max_images_per_batch="
            f"{job.dataloader.max_images_per_batch}: the collator would drop samples"
        )
    from torchtitan_ext.embedded_data import ensure_embedded_assets

    ensure_embedded_assets()  # the debug jobs' data, as the launcher makes it
    return job.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=job.tokenizer.build(tokenizer_path=job.hf_assets_path),
        seq_len=job.training.seq_len,
        local_batch_size=batch_size,
    )


def take_batches(dataloader, n: int) -> list[_Batch]:
    """The first ``n`` batches of ``dataloader``."""
    batches = list(itertools.islice(dataloader, n))
    if len(batches) < n:
        raise RuntimeError(f"the dataloader ended after {len(batches)} of {n} batches")
    return batches


def shuffle_images(
    batches: list[_Batch], *, seed: int = 0
) -> tuple[list[_Batch], float, int]:
    """(batches with images permuted among equal grids, fraction moved, images).

    Pixel rows are padded per batch: a moved image fills as many patches in its
    new row, and the padding stays as the collator left it.
    """
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


def caption_loss(model, batches: list[_Batch]) -> tuple[float, int]:
    """Summed fp32 cross-entropy over labels != -100, and the token count.

    Inputs as the plug-in Trainer builds them (no CP); the jobs' ``spmd_types``
    backend needs a device mesh, ``partial_dtensor`` computes the same without.
    """
    import torch
    import torch.nn.functional as F

    from torchtitan_ext.muse_glimmer import build_vision_bank_indices
    from torchtitan_ext.tools.simulated_cluster import spmd_backend

    total = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad(), spmd_backend("partial_dtensor"):
        for inputs, labels in batches:
            kwargs = {k: v for k, v in inputs.items() if k != "input"}
            kwargs["attention_masks"] = model.get_attention_masks(inputs["positions"])
            if inputs.get("pixel_values") is not None:
                kwargs["vision_bank_indices"] = build_vision_bank_indices(
                    inputs["input"],
                    inputs["grid_thw"],
                    image_id=inputs["special_tokens"]["image_id"],
                    spatial_merge_size=model.config.vision_encoder.downsample_factor,
                )
            logits = model(inputs["input"], **kwargs).float()
            total += F.cross_entropy(
                logits.flatten(0, 1),
                labels.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            ).double()
            count += int((labels != IGNORE_INDEX).sum())
    return float(total), count


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
    from torchtitan_ext import cpu_backend
    from torchtitan_ext.embedded_data import EmbeddedDataConfig, ensure_embedded_assets

    cpu_backend.apply()
    dataset, dataset_path = "embedded", None
    with tempfile.TemporaryDirectory(prefix="vision-probe-") as tmp:
        if heldout_seed is not None:
            dataset = f"heldout-seed-{heldout_seed}"
            n = batches * batch_size
            config = EmbeddedDataConfig(seed=heldout_seed, num_samples=n, num_shards=1)
            assets = ensure_embedded_assets(Path(tmp) / "heldout", config=config)
            dataset_path = assets.dataset_dir
        job = build_probe_job(seq_len=seq_len, dataset_path=dataset_path)
        model = load_probe_model(job, checkpoint)
        # A fresh loader: the dataset's first samples, in file order.
        loader = build_probe_dataloader(job, batch_size=batch_size)
        data = take_batches(loader, batches)
    shuffled, moved_fraction, n_images = shuffle_images(data, seed=seed)
    true_sum, n_tokens = caption_loss(model, data)
    shuffled_sum, n_tokens_shuffled = caption_loss(model, shuffled)
    assert n_tokens == n_tokens_shuffled and n_tokens > 0
    true_loss, shuffled_loss = true_sum / n_tokens, shuffled_sum / n_tokens
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
    """A small table of one probe."""
    rows = [
        ("true images", f"{result.true_loss:.4f}"),
        ("shuffled images", f"{result.shuffled_loss:.4f}"),
        ("difference", f"{result.difference:+.4f}"),
        ("caption tokens", str(result.n_tokens)),
        ("samples / images", f"{result.n_samples} / {result.n_images}"),
        ("images moved", f"{result.moved_fraction:.1%}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"vision probe: {result.checkpoint} ({result.dataset})"]
    return "\n".join(lines + [f"  {name:<{width}}  {value}" for name, value in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.vision_probe",
        description="Caption-token loss of a muse_glimmer checkpoint with true "
        "vs shuffled images (CPU, one process).",
    )
    add = parser.add_argument
    add("--checkpoint", required=True, help="DCP folder, e.g. <dump>/checkpoint/step-N")
    add("--batches", type=int, default=8, help="batches to score")
    add("--batch-size", type=int, default=8, help="samples per batch (at most 8)")
    add("--seq-len", type=int, default=64, help="row length (longest sample ~30)")
    add("--seed", type=int, default=0, help="shuffle generator seed")
    add("--heldout-seed", type=int, help="score fresh images of this generator seed")
    add("--json", type=Path, help="also write the result here")
    kwargs = vars(parser.parse_args(argv))
    json_path = kwargs.pop("json")
    result = run_probe(**kwargs)
    print(format_result(result))
    payload = json.dumps(asdict(result), indent=2)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(payload + "\n")
    print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
