"""Pipeline split of muse_glimmer: the multimodal embedding lives on stage 0.

The vision encoder, adapter, projection and perception norm feed the token
embeddings inside the model's forward, so they must sit on the first stage with
``tok_embeddings``. Upstream's ``pipeline_muse_glimmer`` adds them to generated
splits only; a user's ``module_fqns_per_model_part`` that omits them would
prune them on every stage. This wrapper completes such a split and rejects one
that puts them elsewhere, then hands over to upstream.
"""

import dataclasses

from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.muse_glimmer.parallelize import (
    pipeline_muse_glimmer as upstream_pipeline_muse_glimmer,
)
from torchtitan.tools.logging import logger

from .sharding import VISION_MODULE_FQNS

__all__ = ["pipeline_muse_glimmer", "vision_on_first_stage"]


def _owner(fqn: str, modules: tuple[str, ...]) -> str | None:
    return next((m for m in modules if fqn == m or fqn.startswith(f"{m}.")), None)


def vision_on_first_stage(
    module_fqns_per_model_part: list[list[str]], vision_fqns: tuple[str, ...]
) -> list[list[str]]:
    """The split with every module of ``vision_fqns`` in part 0.

    Modules the split leaves out are prepended to part 0 (a stage keeps its
    modules by name, so the position does not matter). A vision module named on
    another part, or only in pieces, and a split whose part 0 lacks
    ``tok_embeddings``, are errors: the embedding stage needs all of them.
    """
    parts = [list(part) for part in module_fqns_per_model_part]
    if not parts or "tok_embeddings" not in parts[0]:
        first = parts[0] if parts else None
        raise ValueError(
            "parallelism.module_fqns_per_model_part must put 'tok_embeddings' in "
            f"its first part, with the vision modules {list(vision_fqns)}; got "
            f"first part {first}."
        )
    for index, part in enumerate(parts):
        for fqn in part:
            owner = _owner(fqn, vision_fqns)
            if owner is None:
                continue
            if fqn != owner:
                raise ValueError(
                    f"parallelism.module_fqns_per_model_part part {index} names "
                    f"{fqn!r}, a piece of {owner!r}; name the whole module "
                    f"{owner!r}, in part 0 or not at all (then it goes to part 0)."
                )
            if index != 0:
                raise ValueError(
                    f"parallelism.module_fqns_per_model_part puts {fqn!r} in part "
                    f"{index}; muse_glimmer's vision modules {list(vision_fqns)} "
                    "must be in part 0 (the first stage, with tok_embeddings), or "
                    "left out to be placed there."
                )
    missing = [fqn for fqn in vision_fqns if fqn not in parts[0]]
    if missing:
        logger.info(f"Placing {missing} on the first pipeline stage")
        parts[0][:0] = missing
    return parts


def pipeline_muse_glimmer(
    model,
    *,
    parallel_dims: ParallelDims,
    parallelism: ParallelismConfig,
    model_config,
    **kwargs,
):
    """Upstream's pipelining of muse_glimmer, with a user split made whole."""
    if parallelism.module_fqns_per_model_part is not None:
        present = tuple(
            fqn for fqn in VISION_MODULE_FQNS if getattr(model, fqn, None) is not None
        )
        parallelism = dataclasses.replace(
            parallelism,
            module_fqns_per_model_part=vision_on_first_stage(
                parallelism.module_fqns_per_model_part, present
            ),
        )
    return upstream_pipeline_muse_glimmer(
        model,
        parallel_dims=parallel_dims,
        parallelism=parallelism,
        model_config=model_config,
        **kwargs,
    )
