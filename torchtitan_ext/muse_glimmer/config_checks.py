"""Start-up checks of a muse_glimmer job, run on the config alone.

Each check raises ``ValueError`` naming the offending values and what would be
valid. They read only the job's config and the world size, so every rank raises
the same error before the device mesh, the model or any collective exists:
``MuseGlimmerTrainer.init_distributed`` runs them all (``check_job_config``).
Upstream's own start-up errors that already name their values (an explicit
``data_parallel_shard_degree`` that does not multiply out, a missing tokenizer
special token or dataset file, a generated pipeline split that does not fit)
are left to upstream.
"""

import math
import re

from torchtitan.config import ParallelismConfig
from torchtitan.distributed.pipeline_parallel import (
    PipelineScheduleSingle,
    get_schedule_class,
)
from torchtitan.models.muse_glimmer.model import _window_mask_key

from .parallelize import check_cp_parallelize

__all__ = [
    "check_context_parallel",
    "check_image_settings",
    "check_job_config",
    "check_parallel_degrees",
    "check_pipeline_split",
    "check_tensor_parallel_heads",
]

_LAYER_FQN = re.compile(r"layers\.(\d+)")
# Below it, normalising [0, 1] pixels gives values past 1e6 (inf at 1e-45).
_MIN_IMAGE_STD = 1e-6


def _cp_seq_len_divisor(tp: int, cp: int) -> int:
    return math.lcm(2 * tp * cp, 128 * cp)


def check_parallel_degrees(parallelism: ParallelismConfig, world_size: int) -> None:
    """With ``data_parallel_shard_degree=-1`` the other degrees must divide the world.

    ``ParallelDims`` infers dp_shard as ``world_size // product`` and then fails
    on a bare ``assert dp_shard >= 1`` (product larger than the world) or names
    the inferred dp_shard the user never set (product not dividing it).
    """
    if parallelism.data_parallel_shard_degree != -1:
        return
    degrees = {
        "data_parallel_replicate_degree": parallelism.data_parallel_replicate_degree,
        "context_parallel_degree": parallelism.context_parallel_degree,
        "tensor_parallel_degree": parallelism.tensor_parallel_degree,
        "pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
    }
    if any(degree < 1 for degree in degrees.values()):
        return  # ParallelDims names a degree below 1 itself.
    product = math.prod(degrees.values())
    if world_size % product != 0:
        named = " * ".join(f"{name}={degree}" for name, degree in degrees.items())
        raise ValueError(
            f"{named} = {product} must divide the world size {world_size} "
            "(data_parallel_shard_degree=-1 takes the quotient); launch a "
            f"multiple of {product} ranks or lower the degrees so that their "
            f"product divides {world_size}."
        )


def check_context_parallel(model_config, config) -> None:
    """``training.seq_len`` and the ptrr mask key must suit the CP degree.

    Each CP rank holds ``seq_len / cp`` tokens in two chunks (load balancing),
    the flex masks are rebuilt in blocks of 128 per rank, and sequence
    parallelism splits each rank's tokens over tp: ``seq_len`` must be a
    multiple of lcm(2*tp*cp, 128*cp). A CP degree too large for ``seq_len``
    leaves 0 as the lower multiple (the message offers the smallest valid
    length); one whose smallest valid length exceeds the model's
    ``max_seq_len`` allows none (the message names the largest CP degree).
    """
    parallelism = config.parallelism
    _check_cp_vision_mode(parallelism)
    cp = parallelism.context_parallel_degree
    if cp <= 1:
        return
    tp = parallelism.tensor_parallel_degree
    seq_len = config.training.seq_len
    divisor = _cp_seq_len_divisor(tp, cp)
    max_seq_len = model_config.max_seq_len
    if divisor > max_seq_len:
        largest = max(
            (c for c in range(1, cp) if _cp_seq_len_divisor(tp, c) <= max_seq_len),
            default=1,
        )
        raise ValueError(
            f"context_parallel_degree={cp} needs training.seq_len to be a multiple "
            f"of lcm(2*tp*cp, 128*cp) = {divisor} with tensor_parallel_degree={tp}, "
            f"more than the model's max_seq_len={max_seq_len}; the largest "
            f"context_parallel_degree this model allows is {largest}."
        )
    if seq_len % divisor != 0:
        lower = seq_len // divisor * divisor
        nearest = [v for v in (lower, lower + divisor) if 0 < v <= max_seq_len]
        raise ValueError(
            f"training.seq_len={seq_len} must be divisible by "
            f"lcm(2*tp*cp, 128*cp) = lcm({2 * tp * cp}, {128 * cp}) = "
            f"{divisor} with tensor_parallel_degree={tp} and "
            f"context_parallel_degree={cp}; nearest valid values: "
            f"{', '.join(map(str, nearest))}."
        )
    if parallelism.context_parallel_load_balancer == "ptrr":
        mask_keys = sorted(
            {
                _window_mask_key(layer.attention.window_size)
                for layer in model_config.layers
            }
        )
        key = parallelism.context_parallel_ptrr_mask_key
        if key not in mask_keys:
            raise ValueError(
                "context_parallel_load_balancer='ptrr' needs "
                "parallelism.context_parallel_ptrr_mask_key to name one "
                f"of muse_glimmer's attention masks {mask_keys}; got {key!r}."
            )


def _check_cp_vision_mode(parallelism) -> None:
    """``context_parallel_vision`` is a known mode; sharded needs spmd_types."""
    mode = getattr(parallelism, "context_parallel_vision", "replicated")
    if mode not in ("replicated", "sharded"):
        raise ValueError(
            f"parallelism.context_parallel_vision={mode!r} is not a mode; "
            "choose 'replicated' (every CP rank encodes all images) or "
            "'sharded' (each CP rank encodes a share)."
        )
    if mode == "sharded" and parallelism.spmd_backend != "spmd_types":
        raise ValueError(
            "parallelism.context_parallel_vision='sharded' exchanges the vision "
            "rows on the spmd_types mesh; it needs parallelism.spmd_backend="
            f"'spmd_types', got {parallelism.spmd_backend!r}."
        )


def check_tensor_parallel_heads(model_config, tp: int) -> None:
    """TP shards every attention by head: the decoder's q and kv, and the vision's.

    Upstream checks the decoder's heads one count at a time and the vision
    encoder's only once the model is built and parallelized; this names every
    count and the degrees that divide them all.
    """
    if tp <= 1:
        return
    attention = model_config.layers[0].attention
    n_heads = attention.n_heads
    heads = {
        "n_heads": n_heads,
        "n_kv_heads": getattr(attention, "n_kv_heads", None) or n_heads,
    }
    encoder = getattr(model_config, "vision_encoder", None)
    if encoder is not None:
        heads["vision_encoder.num_heads"] = encoder.num_heads
    if all(count % tp == 0 for count in heads.values()):
        return
    common = math.gcd(*heads.values())
    valid = [d for d in range(1, common + 1) if common % d == 0]
    named = ", ".join(f"{name} ({count})" for name, count in heads.items())
    raise ValueError(
        f"tensor_parallel_degree ({tp}) must divide every attention head count: "
        f"{named}; valid degrees: {valid}."
    )


def check_pipeline_split(parallelism: ParallelismConfig, num_layers: int) -> None:
    """A user's ``module_fqns_per_model_part`` must fit the schedule and the model.

    Upstream validates generated splits only. A user's split with more parts
    than a single-stage schedule runs (one per rank) builds stages that wait for
    neighbours no rank runs, failing on a microbatch count or hanging; a
    decoder layer named twice, out of order or not at all, or ``norm`` /
    ``lm_head`` off the last part, silently trains another model.
    """
    parts = parallelism.module_fqns_per_model_part
    if parts is None or parallelism.pipeline_parallel_degree <= 1:
        return
    pp = parallelism.pipeline_parallel_degree
    schedule = parallelism.pipeline_parallel_schedule
    if not parallelism.pipeline_parallel_schedule_csv and issubclass(
        get_schedule_class(schedule), PipelineScheduleSingle
    ):
        if len(parts) != pp:
            raise ValueError(
                f"parallelism.module_fqns_per_model_part has {len(parts)} parts; "
                f"pipeline_parallel_schedule={schedule!r} runs one stage per rank, "
                f"so with pipeline_parallel_degree={pp} it needs exactly {pp} parts "
                "(or choose a multi-stage schedule such as 'Interleaved1F1B')."
            )
    order = [
        int(match.group(1))
        for part in parts
        for fqn in part
        if (match := _LAYER_FQN.fullmatch(fqn))
    ]
    if order != list(range(num_layers)):
        raise ValueError(
            "parallelism.module_fqns_per_model_part must name layers.0 .. "
            f"layers.{num_layers - 1} once each, in order across its parts (the "
            f"model has {num_layers} decoder layers); got layers {order}."
        )
    for fqn in ("norm", "lm_head"):
        owners = [index for index, part in enumerate(parts) if fqn in part]
        if owners != [len(parts) - 1]:
            raise ValueError(
                f"parallelism.module_fqns_per_model_part must put {fqn!r} in its "
                f"last part (part {len(parts) - 1}) only; got it in parts {owners}."
            )


def check_image_settings(dataloader, section: str) -> None:
    """Image normalisation and pixel budget of a multimodal loader config.

    torchtitan 0.3.0 takes them as given: a std of 0 or 1e-45 turns every pixel
    into inf, NaN poisons every image, ``min_pixels > max_pixels`` resizes past
    the budget, and ``max_images_per_batch = 0`` drops every sample with an
    image, all without an error.
    """
    for name in ("image_mean", "image_std"):
        values = tuple(getattr(dataloader, name))
        if len(values) != 3 or not all(math.isfinite(v) for v in values):
            raise ValueError(
                f"{section}.{name} = {values}: need 3 finite values, one per RGB "
                "channel (torchtitan's default is (0.5, 0.5, 0.5))."
            )
    low = [v for v in dataloader.image_std if v < _MIN_IMAGE_STD]
    if low:
        raise ValueError(
            f"{section}.image_std = {tuple(dataloader.image_std)}: every value must "
            f"be at least {_MIN_IMAGE_STD:g} (pixels are divided by it); got {low}."
        )
    merged = (dataloader.patch_size * dataloader.spatial_merge_size) ** 2
    if not merged <= dataloader.min_pixels <= dataloader.max_pixels:
        raise ValueError(
            f"{section}.min_pixels = {dataloader.min_pixels} and max_pixels = "
            f"{dataloader.max_pixels}: need {merged} <= min_pixels <= max_pixels "
            f"({merged} pixels: one {dataloader.spatial_merge_size}x"
            f"{dataloader.spatial_merge_size} merge of {dataloader.patch_size}-pixel "
            "patches, the smallest image the encoder takes)."
        )
    if dataloader.max_images_per_batch < 1:
        raise ValueError(
            f"{section}.max_images_per_batch = {dataloader.max_images_per_batch}: "
            "need at least 1 (the collator would drop every sample with an image)."
        )


def check_job_config(config, world_size: int) -> None:
    """Every start-up check of a muse_glimmer job; needs no mesh or collective."""
    parallelism = config.parallelism
    check_parallel_degrees(parallelism, world_size)
    model_config = config.model_spec.model if config.model_spec else None
    if getattr(model_config, "vision_encoder", None) is None:
        return
    check_cp_parallelize(parallelism.context_parallel_degree)
    check_context_parallel(model_config, config)
    check_tensor_parallel_heads(model_config, parallelism.tensor_parallel_degree)
    check_pipeline_split(parallelism, len(model_config.layers))
    loaders = {"dataloader": config.dataloader}
    if getattr(config, "validator", None) is not None and config.validator.enable:
        loaders["validator.dataloader"] = config.validator.dataloader
    for section, dataloader in loaders.items():
        if hasattr(dataloader, "image_std"):
            check_image_settings(dataloader, section)
