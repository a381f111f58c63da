"""Runnable jobs of the plug-in: muse_glimmer's multimodal debug model on embedded data.

Each function returns a whole ``MuseGlimmerTrainer.Config``; select one with
``--module torchtitan_ext.muse_glimmer --config <function>``.
"""

import dataclasses

from torchtitan.models.muse_glimmer import config_registry as upstream
from torchtitan.trainer import Trainer

from torchtitan_ext.embedded_data import ensure_embedded_assets

from . import model_registry
from .trainer import MuseGlimmerTrainer, MuseGlimmerValidator

__all__ = ["muse_glimmer_debugmodel_mm"]


def _as(config_cls: type, config):
    """Re-type a config dataclass as a subclass, keeping every field's value."""
    return config_cls(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    )


def _plugin_job(config: Trainer.Config, flavor: str) -> MuseGlimmerTrainer.Config:
    """An upstream job, run by the plug-in's Trainer and model on embedded data."""
    assets = ensure_embedded_assets()
    job = _as(MuseGlimmerTrainer.Config, config)
    job.validator = _as(MuseGlimmerValidator.Config, config.validator)
    job.model_spec = model_registry(flavor, attn_backend="flex")
    job.hf_assets_path = str(assets.tokenizer_dir)
    job.dataloader.dataset_path = str(assets.dataset_dir)
    return job


def muse_glimmer_debugmodel_mm() -> MuseGlimmerTrainer.Config:
    """torchtitan's ``muse_glimmer_debugmodel_mm``, trained on the embedded data."""
    return _plugin_job(upstream.muse_glimmer_debugmodel_mm(), "debugmodel_mm")
