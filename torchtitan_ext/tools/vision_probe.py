"""Does a trained muse_glimmer read its images? Caption loss, true vs shuffled images.

``python -m torchtitan_ext.tools.vision_probe --checkpoint DIR [--batches N]``

The embedded captions are a function of the image (count, background, colour,
shape and quadrant of every object; see ``torchtitan_ext.embedded_data``), so a
model that learned the vision path predicts caption tokens much better with
the sample's own image than with another sample's. The probe loads a model-only
DCP checkpoint (``--checkpoint.last_save_model_only``, i.e.
``<dump_folder>/checkpoint/step-N``; a full training checkpoint works too, only
its model keys are read) into the plug-in model in one CPU process, reads N
batches with torchtitan's ``MMDataLoader`` built from the job's own dataloader
config, and computes the mean cross-entropy over the caption tokens
(labels != -100, i.e. the caption words and EOS):

* ``true``: every sample with its own image;
* ``shuffled``: the images permuted across the N batches' samples, only among
  images with the same ``grid_thw``, so every sample keeps a valid placeholder
  count and only the image content changes. Within each ``grid_thw`` group the
  permutation is one random cycle (fixed generator), so every image of a group
  of two or more goes to another sample; the fraction that moved is reported.

Both passes score the same batches, tokens and labels, in fp32 under
``torch.no_grad``. The vision inputs take the path the plug-in's Trainer gives
them: ``build_vision_bank_indices`` on the tokens, masks from
``model.get_attention_masks(positions)``.

Rows are not packed (one sample per row). A row's padding cannot change the
loss of its tokens (causal, per-document masks), so ``--seq-len`` only has to
hold the longest sample, about 30 tokens: the default 64 gives bitwise the
same losses as the training jobs' 256, four times faster.

``--heldout-seed S`` scores freshly generated images instead (the embedded
generator with seed S, written to a temporary folder), which no training run
has seen: the gap then shows that the model reads images rather than
recognising memorised samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HELDOUT_SEED",
    "LEARNED_MARGIN",
    "ProbeResult",
    "build_probe_dataloader",
    "build_probe_job",
    "caption_loss",
    "format_result",
    "load_probe_model",
    "main",
    "probe_training_args",
    "run_probe",
    "seed_checkpoint_args",
    "shuffle_images",
]

IGNORE_INDEX = -100
# The embedded generator's seed for images no training run has seen.
HELDOUT_SEED = 9876
# A run has learned the vision path when its held-out gap exceeds this: half
# the smallest gap of the fp32 runs (CP2, 0.091).
LEARNED_MARGIN = 0.045

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


def seed_checkpoint_args(seed: int = 42) -> list[str]:
    """``run_train.sh`` flags (1 rank, packed TOML) writing the initial weights."""
    return [
        *_probe_job_args(seed),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
    ]


# At 8e-3 the fp32 CP2 run of seed 42 learned on an AMD EPYC and collapsed on
# an Intel Xeon (every image encoded alike; so did the run before the #4244
# backport); 4e-3 and 2e-3 learned there (held-out gaps 0.092, 0.085).
PROBE_LR = "2e-3"


def probe_training_args(
    *, steps: int, seed_checkpoint: str | Path, fp32: bool, seed: int = 42
) -> list[str]:
    """``run_train.sh`` flags of a probe training run on a packed-job TOML.

    One 256-token row per rank, lr 2e-3 after 5 warmup steps, clipping at 1,
    weights from ``seed_checkpoint``, a final model-only float32 checkpoint at
    ``steps`` for the probe. ``fp32`` keeps FSDP's parameters in float32 (as
    the parity suites do) instead of the job's default bf16 mixed precision.
    """
    precision = ["--training.mixed_precision_param", "float32"] if fp32 else []
    return [
        *_probe_job_args(seed),
        *precision,
        "--training.steps",
        str(steps),
        "--optimizer.param-groups.0.optimizer-kwargs.lr",
        PROBE_LR,
        "--lr_scheduler.warmup_steps",
        "5",
        "--training.max_norm",
        "1.0",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "float32",
        f"--checkpoint.initial_load_path={seed_checkpoint}",
        "--checkpoint.initial_load_model_only",
        "activation-checkpoint:none",
    ]


def _probe_job_args(seed: int) -> list[str]:
    return [
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "1",
        "--debug.deterministic",
        f"--debug.seed={seed}",
    ]


def build_probe_job(*, seq_len: int, dataset_path: str | Path | None = None):
    """The plug-in's ``muse_glimmer_debugmodel_mm`` job (1 rank) at ``seq_len``.

    Call ``torchtitan_ext.cpu_backend.apply()`` first (``run_probe`` does).
    """
    from torchtitan_ext.muse_glimmer.config_registry import (
        muse_glimmer_debugmodel_mm,
    )

    job = muse_glimmer_debugmodel_mm()
    job.training.seq_len = seq_len
    if dataset_path is not None:
        job.dataloader.dataset_path = str(dataset_path)
    return job


def load_probe_model(job, checkpoint: str | Path):
    """The job's model on CPU in fp32, weights from a DCP checkpoint's model keys."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = Path(checkpoint)
    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(
            f"{checkpoint} is not a DCP checkpoint (no .metadata); pass the "
            "step folder, e.g. <dump_folder>/checkpoint/step-N"
        )
    model_config = job.model_spec.model
    model_config.update_from_config(config=job)
    # fp32 is the default dtype; no .to(dtype): it would drop RoPE's complex cache.
    model = model_config.build()
    not_fp32 = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if not_fp32:
        raise TypeError(f"parameters not in float32: {not_fp32[:3]}")
    state_dict = model.state_dict()
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    missing = sorted(set(state_dict) - set(saved))
    if missing:
        raise KeyError(
            f"{checkpoint} lacks {len(missing)} model keys, e.g. {missing[:3]}; "
            "is it a checkpoint of muse_glimmer debugmodel_mm?"
        )
    dcp.load(state_dict, checkpoint_id=str(checkpoint))
    model.load_state_dict(state_dict, strict=True)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            raise TypeError(f"{name} loaded as {tensor.dtype}, not float32")
    model.eval()
    return model


def build_probe_dataloader(job, *, batch_size: int):
    """torchtitan's ``MMDataLoader`` from the job's dataloader config, 1 DP rank."""
    if batch_size > job.dataloader.max_images_per_batch:
        raise ValueError(
            f"batch_size={batch_size} exceeds the job's max_images_per_batch="
            f"{job.dataloader.max_images_per_batch}: the collator would drop samples"
        )
    from torchtitan_ext.embedded_data import ensure_embedded_assets

    ensure_embedded_assets()  # the debug jobs' data, as the launcher makes it
    tokenizer = job.tokenizer.build(tokenizer_path=job.hf_assets_path)
    return job.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=job.training.seq_len,
        local_batch_size=batch_size,
    )


def take_batches(dataloader, n: int) -> list[_Batch]:
    """The first ``n`` batches of ``dataloader``."""
    batches = []
    for batch in dataloader:
        batches.append(batch)
        if len(batches) == n:
            return batches
    raise RuntimeError(f"the dataloader ended after {len(batches)} of {n} batches")


def shuffle_images(
    batches: list[_Batch], *, seed: int = 0
) -> tuple[list[_Batch], float, int]:
    """The batches with their images permuted across samples among equal grids.

    Returns (new batches, fraction of images that moved to another sample,
    number of images). Tokens, labels, positions and ``grid_thw`` are the
    originals; image k of a batch keeps its grid, so its placeholder run still
    fits. Pixel rows are padded per batch: a moved image fills the same number
    of patches in its new row, and the padding stays as the collator left it.
    """
    import torch

    slots: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for b, (inputs, _) in enumerate(batches):
        if inputs.get("pixel_values") is None:
            continue
        for i, thw in enumerate(inputs["grid_thw"].tolist()):
            slots.setdefault(tuple(thw), []).append((b, i))

    new_pixels = [
        None if inputs.get("pixel_values") is None else inputs["pixel_values"].clone()
        for inputs, _ in batches
    ]
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


@contextlib.contextmanager
def _plain_tensors():
    """Run the model on plain tensors in one process.

    Under the jobs' ``spmd_types`` backend the forward asserts SPMD types,
    which needs a device mesh. With plain tensors and no mesh the
    ``partial_dtensor`` backend computes the same thing without the asserts.
    """
    from torchtitan.distributed import utils as dist_utils

    previous = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend("partial_dtensor")
    try:
        yield
    finally:
        dist_utils.set_spmd_backend(previous)


def _model_inputs(model, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Tokens and forward kwargs as the plug-in's Trainer builds them (no CP)."""
    from torchtitan_ext.muse_glimmer import build_vision_bank_indices

    tokens = inputs["input"]
    kwargs = {k: v for k, v in inputs.items() if k != "input"}
    kwargs["attention_masks"] = model.get_attention_masks(inputs["positions"])
    if inputs.get("pixel_values") is not None:
        kwargs["vision_bank_indices"] = build_vision_bank_indices(
            tokens,
            inputs["grid_thw"],
            image_id=inputs["special_tokens"]["image_id"],
            spatial_merge_size=model.config.vision_encoder.downsample_factor,
        )
    return tokens, kwargs


def caption_loss(model, batches: list[_Batch]) -> tuple[float, int]:
    """Summed fp32 cross-entropy over labels != -100, and the token count."""
    import torch
    import torch.nn.functional as F

    total = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad(), _plain_tensors():
        for inputs, labels in batches:
            tokens, kwargs = _model_inputs(model, inputs)
            logits = model(tokens, **kwargs).float()
            total += F.cross_entropy(
                logits.flatten(0, 1),
                labels.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            ).double()
            count += int((labels != IGNORE_INDEX).sum())
    return float(total), count


@contextlib.contextmanager
def _dataset(batches: int, batch_size: int, heldout_seed: int | None):
    """(dataset path or None for the job's, name) for the probe's samples."""
    if heldout_seed is None:
        yield None, "embedded"
        return
    from torchtitan_ext.embedded_data import (
        EmbeddedDataConfig,
        ensure_embedded_assets,
    )

    config = EmbeddedDataConfig(
        seed=heldout_seed, num_samples=batches * batch_size, num_shards=1
    )
    with tempfile.TemporaryDirectory(prefix="vision-probe-") as tmp:
        assets = ensure_embedded_assets(Path(tmp) / "heldout", config=config)
        yield assets.dataset_dir, f"heldout-seed-{heldout_seed}"


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
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    with _dataset(batches, batch_size, heldout_seed) as (dataset_path, dataset):
        job = build_probe_job(seq_len=seq_len, dataset_path=dataset_path)
        model = load_probe_model(job, checkpoint)
        # A fresh loader: the dataset's first samples, in file order.
        loader = build_probe_dataloader(job, batch_size=batch_size)
        data = take_batches(loader, batches)
    shuffled, moved_fraction, n_images = shuffle_images(data, seed=seed)
    true_sum, n_tokens = caption_loss(model, data)
    shuffled_sum, n_tokens_shuffled = caption_loss(model, shuffled)
    assert n_tokens == n_tokens_shuffled and n_tokens > 0
    n_samples = sum(
        int((labels != IGNORE_INDEX).any(dim=1).sum()) for _, labels in data
    )
    true_loss, shuffled_loss = true_sum / n_tokens, shuffled_sum / n_tokens
    return ProbeResult(
        checkpoint=str(checkpoint),
        dataset=dataset,
        true_loss=true_loss,
        shuffled_loss=shuffled_loss,
        difference=shuffled_loss - true_loss,
        n_tokens=n_tokens,
        n_samples=n_samples,
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
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.vision_probe",
        description="Caption-token loss of a muse_glimmer checkpoint with true "
        "vs shuffled images (CPU, one process).",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="DCP checkpoint folder, e.g. <dump_folder>/checkpoint/step-N",
    )
    parser.add_argument("--batches", type=int, default=8, help="batches to score")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="samples per batch (at most 8)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=64, help="row length (longest sample ~30)"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle generator seed")
    parser.add_argument(
        "--heldout-seed",
        type=int,
        help="score freshly generated images (embedded generator with this seed)",
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_probe(
        args.checkpoint,
        batches=args.batches,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        heldout_seed=args.heldout_seed,
    )
    print(format_result(result))
    payload = json.dumps(asdict(result), indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(payload + "\n")
    print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
