"""The plug-in's Trainer and Validator: bank indices built before CP sharding."""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import spmd_types as spmd
import torch
from torchtitan.components.validate import Validator
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.distributed.spmd_types import set_current_spmd_mesh
from torchtitan.trainer import Trainer

from .vision_bank import build_vision_bank_indices, check_vision_placeholders

__all__ = ["MuseGlimmerTrainer", "MuseGlimmerValidator"]

_Batch = tuple[dict[str, Any], torch.Tensor]
_ModelInputs = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


def _spatial_merge_size(model_config) -> int | None:
    encoder = getattr(model_config, "vision_encoder", None)
    return None if encoder is None else encoder.downsample_factor


def _post_process_with_bank_indices(
    post_process: Callable[[dict[str, Any], torch.Tensor], _ModelInputs],
    input_dict: dict[str, Any],
    labels: torch.Tensor,
    spatial_merge_size: int | None,
) -> _ModelInputs:
    """Run upstream's post-processing with ``vision_bank_indices`` built and sharded.

    Upstream shards inputs, labels, positions and masks in one ``cp_shard`` call
    and nothing else. Riding along the tokens as a second channel, the bank
    indices go through that same call, so one load balancer permutes them with
    the tokens, whichever balancer it is (headtail, ptrr, or none). A batch
    without images gets indices too (all -1): the model then encodes a blank
    image, so that every rank runs the vision modules (see ``MuseGlimmerModel``).
    """
    if spatial_merge_size is None or "special_tokens" not in input_dict:
        return post_process(input_dict, labels)
    tokens_BL = input_dict["input"]
    vision_bank_indices_BL = build_vision_bank_indices(
        tokens_BL,
        input_dict.get("grid_thw"),
        image_id=input_dict["special_tokens"]["image_id"],
        spatial_merge_size=spatial_merge_size,
    )
    tokens_and_indices_BL2 = torch.stack([tokens_BL, vision_bank_indices_BL], dim=-1)
    inputs_BL2, labels, extra_kwargs = post_process(
        {**input_dict, "input": tokens_and_indices_BL2}, labels
    )
    tokens_BL, vision_bank_indices_BL = (
        channel.contiguous() for channel in inputs_BL2.unbind(-1)
    )
    extra_kwargs["vision_bank_indices"] = vision_bank_indices_BL
    return tokens_BL, labels, extra_kwargs


class MuseGlimmerValidator(Validator):
    """torchtitan's Validator, with the Trainer's bank indices."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def post_dataloading_process(self, input_dict, labels, model_parts):
        return _post_process_with_bank_indices(
            lambda inputs, labels: super(
                MuseGlimmerValidator, self
            ).post_dataloading_process(inputs, labels, model_parts),
            input_dict,
            labels,
            _spatial_merge_size(getattr(model_parts[0], "config", None)),
        )


class MuseGlimmerTrainer(Trainer):
    """torchtitan's Trainer, preparing muse_glimmer's vision inputs for CP."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        validator: MuseGlimmerValidator.Config = field(
            default_factory=MuseGlimmerValidator.Config
        )

    def batch_generator(self, data_iterable: Iterable[_Batch]) -> Iterator[_Batch]:
        """Reject a batch whose placeholders and images disagree, while it is on CPU."""
        spatial_merge_size = _spatial_merge_size(self.model_config)
        for input_dict, labels in super().batch_generator(data_iterable):
            if spatial_merge_size is not None and "special_tokens" in input_dict:
                check_vision_placeholders(
                    input_dict["input"],
                    input_dict.get("grid_thw"),
                    image_id=input_dict["special_tokens"]["image_id"],
                    spatial_merge_size=spatial_merge_size,
                )
            yield input_dict, labels

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> _ModelInputs:
        inputs, labels, extra_kwargs = _post_process_with_bank_indices(
            super().post_dataloading_process,
            input_dict,
            labels,
            _spatial_merge_size(self.model_config),
        )
        vision_bank_indices_BL = extra_kwargs.get("vision_bank_indices")
        if (
            self.config.parallelism.spmd_backend == "spmd_types"
            and vision_bank_indices_BL is not None
        ):
            # Same types as upstream gives the tokens: S(0) dp, S(1) cp, R tp.
            token_type = {
                MeshAxisName.DP: spmd.S(0),
                MeshAxisName.CP: spmd.S(1),
                MeshAxisName.TP: spmd.R,
            }
            with set_current_spmd_mesh(self.parallel_dims.spmd_dense_mesh()):
                spmd.assert_type(inputs, token_type)
                spmd.assert_type(vision_bank_indices_BL, token_type)
        return inputs, labels, extra_kwargs
