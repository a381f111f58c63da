"""The plug-in's Trainer and Validator: bank indices built before CP sharding."""

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import spmd_types as spmd
import torch
from torch import nn
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.spmd_types import set_current_spmd_mesh
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..node_watchdog import NodeWatchdog
from .batch_agreement import SAMPLE_DIGESTS, BatchAgreement
from .config_checks import check_job_config
from .sharding import BATCH_TOKEN_TYPE
from .vision_bank import (
    CpVisionShare,
    build_vision_bank_indices,
    check_pixels_match_grids,
    check_vision_placeholders,
    cp_vision_share,
)

__all__ = [
    "SKIPPED_SAMPLES_TAG",
    "MuseGlimmerMetricsProcessor",
    "MuseGlimmerParallelismConfig",
    "MuseGlimmerTrainer",
    "MuseGlimmerValidator",
    "VisionGeometry",
    "blank_image",
    "post_process_with_vision_bank_indices",
]

SKIPPED_SAMPLES_TAG = "data/skipped_samples"
_SHARE_KEY = "cp_vision_share"

_Batch = tuple[dict[str, Any], torch.Tensor]
_ModelInputs = tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


@dataclass(frozen=True)
class VisionGeometry:
    """What the preprocessing needs of the vision encoder: merge size, widths."""

    spatial_merge_size: int
    patch_dim: int
    vision_dim: int  # the encoder's width, for its cost per image

    @classmethod
    def of(cls, model_config) -> "VisionGeometry | None":
        """The geometry of a model config's vision encoder; None for text-only."""
        encoder = getattr(model_config, "vision_encoder", None)
        if encoder is None:
            return None
        return cls(
            encoder.downsample_factor, encoder.conv1.in_features, encoder.latent_dim
        )


@dataclass(kw_only=True, slots=True)
class MuseGlimmerParallelismConfig(ParallelismConfig):
    """torchtitan's parallelism options, plus how CP ranks share the vision work."""

    context_parallel_vision: Literal["replicated", "sharded"] = "replicated"
    """
    How the CP ranks of a DP group encode its images:
    - "replicated": every CP rank encodes all of them (the vision work and its
      activations do not shrink with CP);
    - "sharded": each CP rank encodes a contiguous, cost-balanced share and
      the ranks exchange the projected rows (one all-gather forward, one
      reduce-scatter backward), so vision work and activations shrink with CP.
    Both train the same model; checkpoints move between them.
    """


def blank_image(
    geometry: VisionGeometry, device: torch.device
) -> dict[str, torch.Tensor]:
    """One all-zero image of the smallest grid, for a batch without images.

    The vision encoder and adapter are FSDP units of their own. A rank (or,
    under PP, a microbatch) that skipped them would miss their all-gather and
    gradient reduce-scatter while ranks with images wait in those collectives.
    Encoding a blank image keeps every rank in step. No token gathers its row
    (every bank index is -1), so the loss is unchanged and the vision gradient
    is exactly zero. Unlike upstream (no gradient at all on such a step), AdamW
    then still moves the vision parameters by momentum and weight decay, the
    same way at every topology.
    """
    merge = geometry.spatial_merge_size
    return {
        "pixel_values": torch.zeros(
            1, merge * merge, geometry.patch_dim, device=device
        ),
        "grid_thw": torch.tensor([[1, merge, merge]], device=device),
    }


def _checked_batches(
    batches: Iterable[_Batch],
    geometry: VisionGeometry | None,
    share_of: Callable[[torch.Tensor], CpVisionShare] | None = None,
    agree: Callable[[dict[str, Any], torch.Tensor], None] | None = None,
) -> Iterator[_Batch]:
    """``batches``, each rejected if its group's ranks or its images disagree.

    Run on the CPU batch, before it moves to the device: ``agree`` (a
    ``BatchAgreement`` check) proves every rank of the group holds this batch,
    then the placeholder check reads its counts on the host, so every rank of
    a CP group raises the same error before any collective. With ``share_of``
    (sharded vision) a batch with images also gets this CP rank's share of
    them, from the same host counts.
    """
    for input_dict, labels in batches:
        if agree is not None:
            agree(input_dict, labels)
        if geometry is not None and "special_tokens" in input_dict:
            grid_thw_N3 = input_dict.get("grid_thw")
            for pixels, grids in (
                ("pixel_values", "grid_thw"),
                ("pixel_values_videos", "grid_thw_videos"),
            ):
                if input_dict.get(pixels) is not None:
                    check_pixels_match_grids(input_dict[pixels], input_dict[grids])
            check_vision_placeholders(
                input_dict["input"],
                grid_thw_N3,
                image_id=input_dict["special_tokens"]["image_id"],
                spatial_merge_size=geometry.spatial_merge_size,
            )
            if share_of is not None and grid_thw_N3 is not None:
                input_dict = {**input_dict, _SHARE_KEY: share_of(grid_thw_N3)}
        yield input_dict, labels


def _share_of(
    parallelism: ParallelismConfig,
    parallel_dims: ParallelDims,
    geometry: VisionGeometry | None,
) -> Callable[[torch.Tensor], CpVisionShare] | None:
    """This CP rank's share of a batch's images, when its vision is sharded."""
    sharded = getattr(parallelism, "context_parallel_vision", "replicated")
    if geometry is None or sharded != "sharded" or not parallel_dims.cp_enabled:
        return None
    return functools.partial(
        cp_vision_share,
        cp_degree=parallel_dims.cp,
        cp_rank=parallel_dims.get_mesh("cp").get_local_rank(),
        spatial_merge_size=geometry.spatial_merge_size,
        vision_dim=geometry.vision_dim,
    )


class _CheckedLoaderConfig:
    """Stands in for the Validator's ``dl_config``: its loader's batches, checked."""

    def __init__(
        self,
        config: BaseDataLoader.Config,
        geometry: VisionGeometry | None,
        share_of: Callable[[torch.Tensor], CpVisionShare] | None,
        agree: Callable[[dict[str, Any], torch.Tensor], None] | None,
    ) -> None:
        self._config = config
        self._geometry = geometry
        self._share_of = share_of
        self._agree = agree

    def build(self, **kwargs) -> Iterator[_Batch]:
        batches = _checked_batches(
            self._config.build(**kwargs), self._geometry, self._share_of, self._agree
        )
        for input_dict, labels in batches:
            yield (
                {
                    key: value if isinstance(value, torch.Tensor) else _HostValue(value)
                    for key, value in input_dict.items()
                },
                labels,
            )


class _HostValue:
    """A batch's non-tensor value (``special_tokens``, a ``CpVisionShare``, None).

    torchtitan 0.3.0's Validator calls ``.to(device)`` on every batch value (its
    Trainer moves tensors only), so a multimodal batch fails there; this one's
    ``.to`` hands the value back unchanged.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def to(self, device: Any) -> Any:
        return self.value


def post_process_with_vision_bank_indices(
    post_process: Callable[[dict[str, Any], torch.Tensor], _ModelInputs],
    input_dict: dict[str, Any],
    labels: torch.Tensor,
    geometry: VisionGeometry | None,
) -> _ModelInputs:
    """Run upstream's post-processing with ``vision_bank_indices`` built and sharded.

    Upstream shards inputs, labels, positions and masks in one ``cp_shard`` call
    and nothing else. Riding along the tokens as a second channel, the bank
    indices go through that same call, so one load balancer permutes them with
    the tokens, whichever balancer it is (headtail, ptrr, or none). A batch
    without images gets a blank image (``blank_image``) and indices all -1.
    With sharded vision (a ``CpVisionShare`` in the batch) the indices are
    built from all images, then the model gets only this rank's share, or a
    blank image when that is empty.
    """
    share = input_dict.get(_SHARE_KEY)
    input_dict = {
        k: v for k, v in input_dict.items() if k not in (_SHARE_KEY, SAMPLE_DIGESTS)
    }
    if geometry is None or "special_tokens" not in input_dict:
        return post_process(input_dict, labels)
    tokens_BL = input_dict["input"]
    if input_dict.get("pixel_values") is None:
        vision_bank_indices_BL = torch.full_like(tokens_BL, -1)
        input_dict = {**input_dict, **blank_image(geometry, tokens_BL.device)}
    else:
        vision_bank_indices_BL = build_vision_bank_indices(
            tokens_BL,
            input_dict["grid_thw"],
            image_id=input_dict["special_tokens"]["image_id"],
            spatial_merge_size=geometry.spatial_merge_size,
        )
    if share is not None:
        start, stop = share.image_range
        input_dict = {
            **input_dict,
            **(
                {
                    "pixel_values": input_dict["pixel_values"][start:stop],
                    "grid_thw": input_dict["grid_thw"][start:stop],
                }
                if stop > start
                else blank_image(geometry, tokens_BL.device)
            ),
        }
    tokens_and_indices_BL2 = torch.stack([tokens_BL, vision_bank_indices_BL], dim=-1)
    inputs_BL2, labels, extra_kwargs = post_process(
        {**input_dict, "input": tokens_and_indices_BL2}, labels
    )
    tokens_BL, vision_bank_indices_BL = (
        channel.contiguous() for channel in inputs_BL2.unbind(-1)
    )
    extra_kwargs["vision_bank_indices"] = vision_bank_indices_BL
    if share is not None:
        extra_kwargs[_SHARE_KEY] = share
    return tokens_BL, labels, extra_kwargs


class MuseGlimmerValidator(Validator):
    """torchtitan's Validator, with the Trainer's batch check and bank indices."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    batch_agreement: BatchAgreement | None = None
    """The Trainer's (one group serves both: they never check at once)."""

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        """Upstream's validation, each batch checked as the Trainer checks it.

        Upstream builds its loader from ``self.dl_config`` inside ``validate``
        and moves each batch to the device right after ``next``, with no hook in
        between; the stand-in config builds that loader with its batches checked.
        """
        dl_config = self.dl_config
        geometry = VisionGeometry.of(getattr(model_parts[0], "config", None))
        share_of = _share_of(self.parallelism, self.parallel_dims, geometry)
        agreement = self.batch_agreement
        self.dl_config = _CheckedLoaderConfig(
            dl_config,
            geometry,
            share_of,
            (
                lambda inputs, labels: agreement.check(
                    inputs, labels, f"step {step}'s validation"
                )
            )
            if agreement is not None
            else None,
        )
        try:
            super().validate(model_parts, step)
        finally:
            self.dl_config = dl_config

    def post_dataloading_process(self, input_dict, labels, model_parts):
        return post_process_with_vision_bank_indices(
            lambda inputs, labels: super(
                MuseGlimmerValidator, self
            ).post_dataloading_process(inputs, labels, model_parts),
            input_dict,
            labels,
            VisionGeometry.of(getattr(model_parts[0], "config", None)),
        )


class MuseGlimmerMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor, also logging the samples the data skipped.

    The Trainer sets ``dataloader`` once built, as upstream sets ``optimizers``
    and ``model_parts``. Its ``skipped_samples`` (see ``RobustMMDataLoader``) is
    this dp rank's count, a host int: logging it costs no sync or collective.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    dataloader: BaseDataLoader | None = None

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        skipped = getattr(self.dataloader, "skipped_samples", None)
        if skipped is not None:
            extra_metrics = {**(extra_metrics or {}), SKIPPED_SAMPLES_TAG: skipped}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if skipped is not None:  # upstream's console line takes no extra metrics
            color = self.color
            logger.info(
                f"{color.red}step: {step:2}  {color.yellow}skipped samples: "
                f"{skipped} on dp rank {self.dataloader.dp_rank}{color.reset}"
            )


class MuseGlimmerTrainer(Trainer):
    """torchtitan's Trainer, preparing muse_glimmer's vision inputs for CP."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        parallelism: MuseGlimmerParallelismConfig = field(
            default_factory=MuseGlimmerParallelismConfig
        )
        validator: MuseGlimmerValidator.Config = field(
            default_factory=MuseGlimmerValidator.Config
        )
        metrics: MuseGlimmerMetricsProcessor.Config = field(
            default_factory=MuseGlimmerMetricsProcessor.Config
        )

    batch_agreement: BatchAgreement | None = None
    """Built with the Trainer; None leaves batches unchecked (the planner's
    simulated rank, which has no peers to agree with)."""
    node_watchdog: NodeWatchdog | None = None
    """Local rank 0's, in a multi-node job."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if isinstance(self.metrics_processor, MuseGlimmerMetricsProcessor):
            self.metrics_processor.dataloader = self.dataloader
        self.batch_agreement = BatchAgreement(self.parallel_dims, self.config.comm)
        if isinstance(getattr(self, "validator", None), MuseGlimmerValidator):
            self.validator.batch_agreement = self.batch_agreement

    def init_distributed(self) -> ParallelDims:
        """Check the job before upstream builds its process group and ``ParallelDims``.

        ``check_job_config`` needs only the config and torchrun's world size, so
        every rank rejects a bad job the same way before any collective, and
        before upstream's shorter checks (``ParallelDims``' bare assert on the
        inferred dp_shard, the Trainer's sequence-length divisor) report less.
        A multi-node job's node watchdog starts with the process group.
        """
        check_job_config(self.config, int(os.environ.get("WORLD_SIZE", "1")))
        parallel_dims = super().init_distributed()
        self.node_watchdog = NodeWatchdog.for_torchrun(
            self.config.comm.init_timeout_seconds
        )
        if self.node_watchdog is not None:
            self.node_watchdog.start()
        return parallel_dims

    def train(self) -> None:
        super().train()
        if self.node_watchdog is not None:
            self.node_watchdog.finished()

    def close(self) -> None:
        if self.node_watchdog is not None:
            self.node_watchdog.stop()
        super().close()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Upstream's, saying so when a resumed job has nothing left to train.

        A second ``./run_train.sh`` finds the first one's final checkpoint in
        the same dump folder, resumes from it and would end without a word.
        """
        super().load_state_dict(state_dict)
        steps = self.config.training.steps
        if self.step >= steps:
            folder = self.checkpointer.folder
            logger.warning(
                f"Resumed at step {self.step} from the checkpoint in {folder}, "
                f"and training.steps is {steps}: nothing left to train. To start "
                f"over, pass another --dump_folder or delete {folder}; to train "
                "on, raise --training.steps."
            )

    def batch_generator(self, data_iterable: Iterable[_Batch]) -> Iterator[_Batch]:
        """Reject a batch that differs across its group, or whose placeholders and
        images disagree, while it is on CPU."""
        geometry = VisionGeometry.of(self.model_config)
        share_of = _share_of(self.config.parallelism, self.parallel_dims, geometry)
        return _checked_batches(
            super().batch_generator(data_iterable),
            geometry,
            share_of,
            (
                lambda inputs, labels: self.batch_agreement.check(
                    inputs, labels, f"training step {self.step}"
                )
            )
            if self.batch_agreement is not None
            else None,
        )

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> _ModelInputs:
        inputs, labels, extra_kwargs = post_process_with_vision_bank_indices(
            super().post_dataloading_process,
            input_dict,
            labels,
            VisionGeometry.of(self.model_config),
        )
        vision_bank_indices_BL = extra_kwargs.get("vision_bank_indices")
        if (
            self.config.parallelism.spmd_backend == "spmd_types"
            and vision_bank_indices_BL is not None
        ):
            # Unstacked, both channels are new tensors: give them the tokens' types.
            with set_current_spmd_mesh(self.parallel_dims.spmd_dense_mesh()):
                spmd.assert_type(inputs, BATCH_TOKEN_TYPE)
                spmd.assert_type(vision_bank_indices_BL, BATCH_TOKEN_TYPE)
        return inputs, labels, extra_kwargs
