"""Runnable jobs of the plug-in: the multimodal debug model on embedded data, and
production jobs of the ``30B_mm`` flavor on GPU clusters.

Each function returns a whole ``MuseGlimmerTrainer.Config``; select one with
``--module torchtitan_ext.muse_glimmer --config <function>``.
"""

import dataclasses

from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.muse_glimmer import config_registry as upstream
from torchtitan.trainer import Trainer

from torchtitan_ext.assets import DATASET_FOLDER, TOKENIZER_FOLDER, default_root

from . import _as, model_registry
from .data import RobustMMDataLoader
from .trainer import (
    MuseGlimmerMetricsProcessor,
    MuseGlimmerParallelismConfig,
    MuseGlimmerTrainer,
    MuseGlimmerValidator,
)

__all__ = [
    "muse_glimmer_debugmodel_mm",
    "muse_glimmer_debugmodel_mm_cp2",
    "muse_glimmer_debugmodel_mm_cp2_pp2",
    "muse_glimmer_debugmodel_mm_cp2_pp2_interleaved",
    "muse_glimmer_debugmodel_mm_cp2_typechecked",
    "muse_glimmer_debugmodel_mm_cp4",
    "muse_glimmer_debugmodel_mm_fsdp2",
    "muse_glimmer_debugmodel_mm_fsdp2_cp2",
    "muse_glimmer_debugmodel_mm_fsdp2_pp2",
    "muse_glimmer_debugmodel_mm_packed",
    "muse_glimmer_debugmodel_mm_quickstart",
    "muse_glimmer_debugmodel_mm_pp2",
    "muse_glimmer_debugmodel_mm_tp2_cp2_pp2_sp",
    "muse_glimmer_debugmodel_mm_tp2_cp2_sp",
    "muse_glimmer_debugmodel_mm_tp2_cp2_sp_typechecked",
    "muse_glimmer_debugmodel_mm_tp2_pp2_sp",
    "muse_glimmer_debugmodel_mm_tp2_sp",
    "muse_glimmer_30b_mm_fsdp4_cp4_tp2_pp4_sp",
    "muse_glimmer_30b_mm_fsdp4_cp4_tp2_sp",
]


def _embedded_data_paths() -> tuple[str, str]:
    """Tokenizer and dataset folders of the generated data (made by the launcher
    on first use, or by ``python -m torchtitan_ext.tools.embedded_data``)."""
    root = default_root()
    return str(root / TOKENIZER_FOLDER), str(root / DATASET_FOLDER)


def _as_plugin_job(config: Trainer.Config, flavor: str) -> MuseGlimmerTrainer.Config:
    """An upstream job, run by the plug-in's Trainer and model on the job's data."""
    job = _as(MuseGlimmerTrainer.Config, config)
    job.parallelism = _as(MuseGlimmerParallelismConfig, config.parallelism)
    job.validator = _as(MuseGlimmerValidator.Config, config.validator)
    job.metrics = _as(MuseGlimmerMetricsProcessor.Config, config.metrics)
    job.dataloader = _as(RobustMMDataLoader.Config, config.dataloader)
    job.model_spec = model_registry(flavor, attn_backend="flex")
    return job


def _plugin_job(config: Trainer.Config, flavor: str) -> MuseGlimmerTrainer.Config:
    """An upstream job, run by the plug-in's Trainer and model on embedded data.

    Its validation reads one pass of the training loader's kind of data (upstream
    leaves c4's text set, which no multimodal job can read offline); point
    ``--validator.dataloader.dataset_path`` at a held-out set.
    """
    job = _as_plugin_job(config, flavor)
    job.hf_assets_path, job.dataloader.dataset_path = _embedded_data_paths()
    job.validator.dataloader = dataclasses.replace(job.dataloader, infinite=False)
    return job


def muse_glimmer_debugmodel_mm() -> MuseGlimmerTrainer.Config:
    """torchtitan's ``muse_glimmer_debugmodel_mm``, trained on the embedded data."""
    return _plugin_job(upstream.muse_glimmer_debugmodel_mm(), "debugmodel_mm")


def muse_glimmer_debugmodel_mm_quickstart() -> MuseGlimmerTrainer.Config:
    """``./run_train.sh``'s default: the debug model visibly learning in minutes.

    Upstream's debug job moves its loss from 7.625 to 7.585 in 10 steps (lr
    8e-4, and the seed's final norm starts at zero). Here a 1e-2 peak lr after
    3 warmup steps, 16 steps, float32 parameters (bf16 matmuls have no fast
    path on many CPUs) and 64-token sequences (a caption with its image is
    about 30 tokens) take the loss below half its first value; TensorBoard
    and a final model checkpoint go to ``<dump_folder>/tb`` and ``/checkpoint``.
    """
    job = muse_glimmer_debugmodel_mm()
    job.optimizer = default_adamw(lr=1e-2)
    job.lr_scheduler = LRSchedulersContainer.Config(
        warmup_steps=3, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.1
    )
    job.training.steps = 16
    job.training.seq_len = 64
    job.training.mixed_precision_param = "float32"
    job.metrics.enable_tensorboard = True
    job.checkpoint.enable = True
    job.checkpoint.interval = job.training.steps
    return job


def muse_glimmer_debugmodel_mm_packed() -> MuseGlimmerTrainer.Config:
    """The multimodal debug job with packed sequences, on one rank.

    CP exists for long, dense sequences, so the CP jobs pack: each sequence
    holds several documents and images at arbitrary offsets, document masks
    shape the ptrr balancer, and image spans cross CP shard boundaries. This job
    is their 1-rank baseline. 512 tokens divide lcm(2*tp*cp, 128*cp) for every
    CP job here; a packed row holds about 20 images, hence the image budget.
    """
    job = muse_glimmer_debugmodel_mm()
    job.dataloader.packing_buffer_size = 32
    job.dataloader.max_images_per_batch = 128
    job.training.seq_len = 512
    job.training.local_batch_size = 2
    job.parallelism.context_parallel_load_balancer = "ptrr"
    job.parallelism.context_parallel_ptrr_mask_key = "global"
    return job


def _packed_with(**degrees: int) -> MuseGlimmerTrainer.Config:
    job = muse_glimmer_debugmodel_mm_packed()
    for name, degree in degrees.items():
        setattr(job.parallelism, name, degree)
    return job


def muse_glimmer_debugmodel_mm_cp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under CP2 (2 ranks)."""
    return _packed_with(context_parallel_degree=2)


def muse_glimmer_debugmodel_mm_cp4() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under CP4 (4 ranks)."""
    return _packed_with(context_parallel_degree=4)


def muse_glimmer_debugmodel_mm_fsdp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under FSDP2 (2 ranks): the FSDP2xCP2 baseline."""
    return _packed_with(data_parallel_shard_degree=2)


def muse_glimmer_debugmodel_mm_fsdp2_cp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under FSDP2 x CP2 (4 ranks)."""
    return _packed_with(data_parallel_shard_degree=2, context_parallel_degree=2)


def muse_glimmer_debugmodel_mm_tp2_sp() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under TP2 with SP (2 ranks): the TP2+CP2+SP baseline."""
    return _packed_with(tensor_parallel_degree=2)


def muse_glimmer_debugmodel_mm_tp2_cp2_sp() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under TP2 + CP2 with SP (4 ranks)."""
    return _packed_with(tensor_parallel_degree=2, context_parallel_degree=2)


def muse_glimmer_debugmodel_mm_pp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under PP2 (1F1B, 2 ranks), two microbatches a step."""
    return _packed_with(pipeline_parallel_degree=2)


def muse_glimmer_debugmodel_mm_fsdp2_pp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under FSDP2 x PP2 (1F1B, 4 ranks)."""
    return _packed_with(data_parallel_shard_degree=2, pipeline_parallel_degree=2)


def muse_glimmer_debugmodel_mm_cp2_pp2() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under CP2 x PP2 (1F1B, 4 ranks)."""
    return _packed_with(context_parallel_degree=2, pipeline_parallel_degree=2)


def muse_glimmer_debugmodel_mm_cp2_pp2_interleaved() -> MuseGlimmerTrainer.Config:
    """CP2 x PP2 with Interleaved1F1B: 4 stages of 2 layers, 2 stages per rank.

    The first and last stages count as full stages here (upstream's default
    discounts one layer for each), so 8 layers make 4 stages.
    """
    job = muse_glimmer_debugmodel_mm_cp2_pp2()
    job.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    job.parallelism.pipeline_parallel_layers_per_stage = 2
    job.parallelism.pipeline_parallel_first_stage_less_layers = 0
    job.parallelism.pipeline_parallel_last_stage_less_layers = 0
    return job


def muse_glimmer_debugmodel_mm_tp2_pp2_sp() -> MuseGlimmerTrainer.Config:
    """TP2 x PP2 with SP (4 ranks): the baseline of the 8-rank TP2xCP2xPP2 job."""
    return _packed_with(tensor_parallel_degree=2, pipeline_parallel_degree=2)


def muse_glimmer_debugmodel_mm_tp2_cp2_pp2_sp() -> MuseGlimmerTrainer.Config:
    """Packed multimodal job under TP2 x CP2 x PP2 with SP (8 ranks)."""
    return _packed_with(
        tensor_parallel_degree=2, context_parallel_degree=2, pipeline_parallel_degree=2
    )


def _typechecked(job: MuseGlimmerTrainer.Config) -> MuseGlimmerTrainer.Config:
    # torchtitan rejects selective AC with flex attention under typechecking.
    job.debug.spmd_typechecking = True
    job.activation_checkpoint = None
    return job


def muse_glimmer_debugmodel_mm_cp2_typechecked() -> MuseGlimmerTrainer.Config:
    """CP2 with ``--debug.spmd_typechecking`` (and no activation checkpointing)."""
    return _typechecked(muse_glimmer_debugmodel_mm_cp2())


def muse_glimmer_debugmodel_mm_tp2_cp2_sp_typechecked() -> MuseGlimmerTrainer.Config:
    """TP2 + CP2 + SP with ``--debug.spmd_typechecking``, no activation checkpoints."""
    return _typechecked(muse_glimmer_debugmodel_mm_tp2_cp2_sp())


# Production jobs: torchtitan's ``muse_glimmer_30b_mm`` (decoder dim 6656, 52
# layers, vocab 202048, a 50-block vision encoder) on clusters of 8-GPU nodes.
# No GPU runs them here: tests/unit/test_simulated_cluster.py builds and
# parallelizes each, a rank at a time, on a fake process group of its world size
# (torchtitan_ext.tools.simulated_cluster).


def _muse_glimmer_30b_mm(
    seq_len: int, local_batch_size: int = 1, **degrees: int
) -> MuseGlimmerTrainer.Config:
    """torchtitan's ``muse_glimmer_30b_mm`` under CP, with explicit degrees.

    Upstream's loss wrapper (chunked, no [B, L, vocab] logits), full activation
    checkpointing, tokenizer assets (``./assets/hf/Muse-Glimmer-30B``) and
    cc12m data are kept; ``--hf_assets_path`` and ``--dataloader.dataset_path``
    point them elsewhere. The data parallel degree is explicit, so a launch on
    the wrong number of ranks fails at start-up naming every degree.
    Sequences are packed, as in the debug CP jobs: a cc12m sample (a caption
    and an image resized to at most 3136 pixels, 4 placeholders) is about 40
    tokens, so an unpacked row would be nearly all padding. One image per 16
    tokens bounds a row's images far above that density.
    TP is 2 at most: it must divide the decoder's 2 kv heads.
    """
    job = _as_plugin_job(upstream.muse_glimmer_30b_mm(), "30B_mm")
    job.training.seq_len = seq_len
    job.training.local_batch_size = local_batch_size
    job.dataloader.packing_buffer_size = 100
    job.dataloader.max_images_per_batch = local_batch_size * seq_len // 16
    job.parallelism.context_parallel_load_balancer = "ptrr"
    job.parallelism.context_parallel_ptrr_mask_key = "global"
    for name, degree in degrees.items():
        setattr(job.parallelism, name, degree)
    return job


def muse_glimmer_30b_mm_fsdp4_cp4_tp2_sp() -> MuseGlimmerTrainer.Config:
    """``30B_mm`` on 4 nodes x 8 GPUs, seq_len 8192: FSDP4 x CP4 x TP2 + SP.

    TP (innermost) and CP share a node's 8 GPUs: CP all-gathers every decoder
    layer's k/v and TP reduces every layer's activations, so both stay on
    NVLink; FSDP's per-layer all-gather and reduce-scatter cross the nodes.
    Each rank holds 2048 tokens of a row, and 1/32 of the parameters.
    """
    return _muse_glimmer_30b_mm(
        8192,
        data_parallel_shard_degree=4,
        context_parallel_degree=4,
        tensor_parallel_degree=2,
    )


def muse_glimmer_30b_mm_fsdp4_cp4_tp2_pp4_sp() -> MuseGlimmerTrainer.Config:
    """``30B_mm`` on 16 nodes x 8 GPUs, seq_len 16384: FSDP4 x CP4 x TP2 + SP x PP4.

    The node holds CP x TP as in the 4-node job; PP4 (outermost, 1F1B) and FSDP4
    cross nodes. 8 microbatches of one row keep the 1F1B bubble at 3/11.
    Stage 0 also holds the embedding (1.34B parameters) and the vision stack
    (1.92B), about 7 decoder layers' worth (0.48B each), and 1F1B keeps the
    most microbatches in flight there; the last stage holds the 1.34B lm_head,
    about 3. The generated split counts them so: 9, 16, 15 and 12 layers.
    """
    job = _muse_glimmer_30b_mm(
        16384,
        local_batch_size=8,
        data_parallel_shard_degree=4,
        context_parallel_degree=4,
        tensor_parallel_degree=2,
        pipeline_parallel_degree=4,
    )
    job.parallelism.pipeline_parallel_first_stage_less_layers = 7
    job.parallelism.pipeline_parallel_last_stage_less_layers = 3
    return job
