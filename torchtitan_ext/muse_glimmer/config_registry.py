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
    "muse_glimmer_30b_mm",
    "muse_glimmer_debugmodel_mm",
    "muse_glimmer_debugmodel_mm_packed",
    "muse_glimmer_debugmodel_mm_packed_typechecked",
    "muse_glimmer_debugmodel_mm_quickstart",
]


def _embedded_data_paths() -> tuple[str, str]:
    """Tokenizer and dataset folders of the generated data (made by the launcher
    on first use, or by ``python -m torchtitan_ext.embedded_data``)."""
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


def muse_glimmer_debugmodel_mm_packed_typechecked() -> MuseGlimmerTrainer.Config:
    """The packed job with ``--debug.spmd_typechecking`` and no activation
    checkpointing (torchtitan rejects selective AC with flex attention under
    typechecking; a TOML cannot unset ``activation_checkpoint``)."""
    job = muse_glimmer_debugmodel_mm_packed()
    job.debug.spmd_typechecking = True
    job.activation_checkpoint = None
    return job


# The released Muse-Glimmer-30B's context window.
MAX_SEQ_LEN_30B = 131_072

# Production jobs: torchtitan's ``muse_glimmer_30b_mm`` (decoder dim 6656, 52
# layers, vocab 202048, a 50-block vision encoder) on clusters of 8-GPU nodes.
# No GPU runs them here: tests/unit/test_simulated_cluster.py builds and
# parallelizes each, a rank at a time, on a fake process group of its world size
# (torchtitan_ext.tools.simulated_cluster).


def muse_glimmer_30b_mm() -> MuseGlimmerTrainer.Config:
    """torchtitan's ``muse_glimmer_30b_mm`` with packed sequences, for CP jobs.

    Upstream's loss wrapper (chunked, no [B, L, vocab] logits), full activation
    checkpointing, tokenizer assets (``./assets/hf/Muse-Glimmer-30B``) and
    cc12m data are kept; ``--hf_assets_path`` and ``--dataloader.dataset_path``
    point them elsewhere. Sequences are packed, as in the debug CP jobs: a
    cc12m sample (a caption and an image resized to at most 3136 pixels, 4
    placeholders) is about 40 tokens, so an unpacked row would be nearly all
    padding. The degrees, sequence length and image budget are each job's
    TOML (``train_configs/30b_mm_*.toml``). RoPE's ``max_seq_len`` is the
    released Muse-Glimmer-30B's 131072 (transformers'
    ``max_position_embeddings``), not the flavor's 16384: a job's ``seq_len``
    may go up to it (the trainer sizes RoPE to ``seq_len``; nothing else moves).
    """
    job = _as_plugin_job(upstream.muse_glimmer_30b_mm(), "30B_mm")
    for layer in job.model_spec.model.layers:
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=MAX_SEQ_LEN_30B)
        layer.attention.rope = rope
    job.dataloader.packing_buffer_size = 100
    job.parallelism.context_parallel_load_balancer = "ptrr"
    job.parallelism.context_parallel_ptrr_mask_key = "global"
    return job
