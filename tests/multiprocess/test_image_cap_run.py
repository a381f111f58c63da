"""A long-context job's layout, one packed row a batch, on the real Trainer: no
row may hold more images than ``max_images_per_batch``, or its batch is empty."""

import re

from ..parity_suites import FP32
from ..training_runs import run_train


def test_one_row_batches_under_a_small_image_cap_train(tmp_path):
    """A 512-token row packs about 20 images; at a cap of 4 upstream's collator
    removes the only row and ``collate_text([])`` ends the job at step 1."""
    run_train(
        tmp_path,
        "image_cap",
        "packed.toml",
        [
            "--training.local_batch_size=1",
            "--dataloader.max_images_per_batch=4",
            "--training.steps=2",
            FP32,
        ],
        timeout_s=300,
    )
    log = (tmp_path / "image_cap.log").read_text()
    assert re.search(r"step:\s+2\b", log), log[-2000:]
    assert "Skipping row" not in log and "Removed sample" not in log
