"""A resumed loader yields what the uninterrupted one does, through later passes.

torchtitan restores HF's stream state on load, and HF re-applies it on every
pass of torchtitan's infinite loop: each later pass restarted at the checkpoint
(replaying the tail of the rank's data), and a checkpoint at the end of that
data made every pass empty, a hang. Each loader here is the packed CP jobs' own,
one of two dp ranks, one process, so a few passes cost seconds.
"""

import threading
from collections.abc import Iterator
from dataclasses import fields

import pytest
import torch
from torchtitan.components.tokenizer import MultiModalTokenizer
from torchtitan.hf_datasets.multimodal.mm_datasets import MMDataLoader
from torchtitan.models.muse_glimmer.config_registry import MUSE_GLIMMER_SPECIAL_TOKENS

from torchtitan_ext.embedded_data import (
    EmbeddedDataConfig,
    ensure_embedded_assets,
)
from torchtitan_ext.muse_glimmer.config_registry import (
    muse_glimmer_debugmodel_mm_packed,
)
from torchtitan_ext.muse_glimmer.data import RobustMMDataLoader

pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding:DeprecationWarning",
)

DP_WORLD_SIZE = 2
SAMPLES_PER_RANK = EmbeddedDataConfig().num_samples // DP_WORLD_SIZE
NUM_BATCHES = 20
NEXT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def assets():
    return ensure_embedded_assets()  # the training jobs' data


@pytest.fixture(scope="module")
def tokenizer(assets):
    return MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(assets.tokenizer_dir)
    )


def _loader(assets, tokenizer, loader_cls: type[MMDataLoader]) -> MMDataLoader:
    """The packed jobs' loader (upstream's or the plug-in's) for dp rank 0 of 2."""
    job = muse_glimmer_debugmodel_mm_packed()
    values = {f.name: getattr(job.dataloader, f.name) for f in fields(job.dataloader)}
    config = loader_cls.Config(**{**values, "dataset_path": str(assets.dataset_dir)})
    return config.build(
        dp_world_size=DP_WORLD_SIZE,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=job.training.seq_len,
        local_batch_size=job.training.local_batch_size,
    )


def _take(batches: Iterator, count: int) -> list[torch.Tensor]:
    """``count`` batches' token ids; a loader that stops yielding fails the test."""
    taken: list[torch.Tensor] = []

    def consume() -> None:
        for _ in range(count):
            inputs, _labels = next(batches)
            taken.append(inputs["input"])

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout=NEXT_TIMEOUT_S)
    assert not thread.is_alive(), f"no batch {len(taken)} within {NEXT_TIMEOUT_S} s"
    assert len(taken) == count, "the loader raised (see the thread's traceback)"
    return taken


def _restored(assets, tokenizer, loader_cls, *, after: int) -> MMDataLoader:
    """A fresh loader given the state another saved after ``after`` batches.

    The packer reads a rank's whole share before its first row, so every such
    state is at the end of the stream, where upstream's resumed loader hangs.
    """
    source = _loader(assets, tokenizer, loader_cls)
    _take(iter(source), after)
    assert source.dataset._sample_idx == SAMPLES_PER_RANK
    restored = _loader(assets, tokenizer, loader_cls)
    restored.load_state_dict(source.state_dict())
    return restored


@pytest.fixture(scope="module")
def uninterrupted(assets, tokenizer) -> list[torch.Tensor]:
    return _take(iter(_loader(assets, tokenizer, RobustMMDataLoader)), NUM_BATCHES)


def _equal(test: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    return len(test) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(test, reference, strict=True)
    )


def test_the_uninterrupted_run_reads_several_passes(uninterrupted):
    """Each pass packs the same rows; at least two later passes are compared."""
    periods = (
        k
        for k in range(1, NUM_BATCHES // 3 + 1)
        if _equal(uninterrupted[k : 2 * k], uninterrupted[:k])
    )
    assert next(periods, None) is not None, "no pass repeats within a third"


@pytest.mark.parametrize("at", [1, 4, 9])
def test_resumed_loader_matches_the_uninterrupted_one(
    assets, tokenizer, uninterrupted, at
):
    resumed = _restored(assets, tokenizer, RobustMMDataLoader, after=at)
    assert _equal(_take(iter(resumed), NUM_BATCHES - at), uninterrupted[at:])


@pytest.mark.parametrize(
    ("loader_cls", "second_pass"), [(MMDataLoader, 0), (RobustMMDataLoader, 1)]
)
def test_a_restored_stream_starts_at_the_checkpoint_once(
    assets, tokenizer, loader_cls, second_pass
):
    """Upstream's restored HF stream restarts at the saved end on every pass."""
    resumed = _restored(assets, tokenizer, loader_cls, after=1)
    iter(resumed)  # loads the dataset's state
    stream = resumed.dataset._data
    assert sum(1 for _ in stream) == 0  # the restored pass: nothing left
    assert sum(1 for _ in stream) == second_pass * SAMPLES_PER_RANK
