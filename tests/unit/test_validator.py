"""The Validator rejects a bad batch with the Trainer's message, on the CPU batch."""

import contextlib
import dataclasses
import io
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchtitan.distributed import ParallelDims
from torchtitan.hf_datasets.multimodal.mm_datasets import MMDataLoader

from torchtitan_ext.embedded_data import ensure_embedded_assets
from torchtitan_ext.muse_glimmer import MuseGlimmerTrainer, MuseGlimmerValidator
from torchtitan_ext.muse_glimmer.config_registry import muse_glimmer_debugmodel_mm


def dataset_with_stray_placeholder(out_dir: Path, key: str = "0002") -> Path:
    """One shard of the embedded set; sample ``key``'s caption spells a placeholder."""
    source = ensure_embedded_assets().dataset_dir / "embedded-0000.tar"
    out_dir.mkdir()
    with tarfile.open(source) as src, tarfile.open(out_dir / "bad.tar", "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == f"{key}.txt":
                data = b"one shape on gray : <|image_pad|> red circle top left"
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    return out_dir


def test_validator_rejects_the_batch_with_the_trainers_message(tmp_path):
    """Both check the CPU batch; upstream's Validator would fail inside the model.

    In process, on one rank: the Trainer's ``batch_generator`` on a Trainer
    holding only what it reads, the Validator built as the Trainer builds it.
    Three samples a batch put the stray placeholder in the first one; the
    loader is torchtitan's (as a user's own loader might be), since the plug-in's
    skips such a sample before it reaches a batch.
    """
    job = muse_glimmer_debugmodel_mm()
    # torchtitan's own loader: the plug-in's skips such a sample by name.
    loader = MMDataLoader.Config(
        **{
            field.name: getattr(job.dataloader, field.name)
            for field in dataclasses.fields(MMDataLoader.Config)
        }
    )
    loader = dataclasses.replace(
        loader,
        dataset_path=str(dataset_with_stray_placeholder(tmp_path / "data")),
        packing_buffer_size=0,
    )
    tokenizer = job.tokenizer.build(tokenizer_path=job.hf_assets_path)
    seq_len, local_batch_size = 256, 3

    trainer = MuseGlimmerTrainer.__new__(MuseGlimmerTrainer)
    trainer.config = job
    trainer.model_config = job.model_spec.model
    trainer.parallel_dims = ParallelDims.from_config(job.parallelism, world_size=1)
    trainer.metrics_processor = SimpleNamespace(
        ntokens_since_last_log=0, data_loading_times=[]
    )
    train_loader = loader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
    )
    with pytest.raises(ValueError, match="Multimodal batch mismatch") as trained:
        next(trainer.batch_generator(train_loader))

    validator = MuseGlimmerValidator.Config(
        enable=True, steps=1, dataloader=loader
    ).build(
        parallelism=job.parallelism,
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        parallel_dims=ParallelDims.from_config(job.parallelism, world_size=1),
        loss_fn=None,
        validation_context=contextlib.nullcontext,
        metrics_processor=trainer.metrics_processor,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
    )
    model = torch.nn.Module()
    model.config = job.model_spec.model
    with pytest.raises(ValueError, match="Multimodal batch mismatch") as validated:
        validator.validate([model], step=1)
    assert str(validated.value) == str(trained.value)
