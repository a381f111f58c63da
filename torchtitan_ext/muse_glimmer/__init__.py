"""muse_glimmer under context parallelism: the plug-in's model package.

The model spec is torchtitan's own muse_glimmer flavor with four replacements:
the model class (vision injection by bank index, same modules and keys), the
vision encoder class (non-square position grids sampled as torchtitan PR #4244
does), the parallelize function (CP allowed for the multimodal flavor) and the
pipelining function (the vision modules on the first stage for a user's split
too). The Trainer and Validator build the bank indices before CP shards the
batch.
"""

import dataclasses

from torchtitan.models.muse_glimmer import model_registry as upstream_model_registry
from torchtitan.protocols.model_spec import ModelSpec

from .data import RobustMMDataLoader
from .model import MuseGlimmerModel, exchange_vision_rows, gather_vision_rows
from .parallelize import parallelize_muse_glimmer
from .pipeline import pipeline_muse_glimmer
from .sharding import VISION_MODULE_FQNS
from .trainer import (
    MuseGlimmerMetricsProcessor,
    MuseGlimmerParallelismConfig,
    MuseGlimmerTrainer,
    MuseGlimmerValidator,
    VisionGeometry,
    blank_image,
    post_process_with_vision_bank_indices,
)
from .vision_bank import (
    CpVisionShare,
    build_vision_bank_indices,
    check_pixels_match_grids,
    check_vision_placeholders,
    cp_vision_share,
    image_encoding_cost,
    split_images_over_cp,
)
from .vision_encoder import MuseGlimmerVisionEncoder, vision_pos_embed

__all__ = [
    "VISION_MODULE_FQNS",
    "CpVisionShare",
    "MuseGlimmerMetricsProcessor",
    "MuseGlimmerParallelismConfig",
    "MuseGlimmerModel",
    "MuseGlimmerTrainer",
    "MuseGlimmerValidator",
    "MuseGlimmerVisionEncoder",
    "RobustMMDataLoader",
    "VisionGeometry",
    "blank_image",
    "build_vision_bank_indices",
    "check_pixels_match_grids",
    "check_vision_placeholders",
    "cp_vision_share",
    "exchange_vision_rows",
    "gather_vision_rows",
    "image_encoding_cost",
    "model_registry",
    "parallelize_muse_glimmer",
    "pipeline_muse_glimmer",
    "post_process_with_vision_bank_indices",
    "split_images_over_cp",
    "vision_pos_embed",
]


def _as(config_cls: type, config):
    """Re-type a config dataclass as a subclass, keeping every field's value."""
    return config_cls(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    )


def model_registry(flavor: str, attn_backend: str = "flex", **kwargs) -> ModelSpec:
    """torchtitan's muse_glimmer ``flavor``, built as the plug-in's model."""
    upstream_spec = upstream_model_registry(flavor, attn_backend=attn_backend, **kwargs)
    model_config = _as(MuseGlimmerModel.Config, upstream_spec.model)
    if model_config.vision_encoder is not None:
        model_config.vision_encoder = _as(
            MuseGlimmerVisionEncoder.Config, model_config.vision_encoder
        )
    return dataclasses.replace(
        upstream_spec,
        model=model_config,
        parallelize_fn=parallelize_muse_glimmer,
        pipelining_fn=pipeline_muse_glimmer,
    )
