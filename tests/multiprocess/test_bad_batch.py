"""Bad data under CP2: a bad sample is skipped and training goes on; a bad batch,
which cannot be half skipped, stops every CP rank with one named error, no hang."""

import pytest

from torchtitan_ext.tools.parity import RUN_TRAIN, launch_run

from ..data_faults import FAULT_ENV
from ..training_runs import REPO, run_train
from ..unit.test_validator import dataset_with_stray_placeholder

TIMEOUT_S = 300
UNPACKED = ["--dataloader.packing_buffer_size=0", "--training.seq_len=256"]


def test_a_caption_spelling_a_placeholder_is_skipped_by_name(tmp_path):
    """torchtitan 0.3.0 (and the plug-in before) ended the run at this batch."""
    dataset = dataset_with_stray_placeholder(tmp_path / "data")
    run_train(
        tmp_path,
        "stray",
        2,
        "cp2.toml",
        [f"--dataloader.dataset_path={dataset}", *UNPACKED, "--training.steps=3"],
        timeout_s=TIMEOUT_S,
        env={"LOG_RANK": "0,1"},
    )
    log = (tmp_path / "stray.log").read_text().splitlines()
    for rank in (0, 1):
        lines = [line for line in log if line.startswith(f"[rank{rank}]:")]
        skips = [line for line in lines if "Skipping sample" in line]
        assert len(skips) == 1, (rank, skips)
        assert ":0002: its text 'txt' contains the special token string(s) " in skips[0]
        assert "['<|image_pad|>']" in skips[0]
        assert any("step:  3" in line for line in lines), rank
        assert any("skipped samples: 1 on dp rank 0" in line for line in lines), rank


@pytest.mark.parametrize("vision", ["replicated", "sharded"])
def test_a_grid_disagreeing_with_its_pixels_stops_every_cp_rank(tmp_path, vision):
    record = launch_run(
        f"short_grid_{vision}",
        {
            "NGPU": "2",
            "LOG_RANK": "0,1",
            "CONFIG_FILE": str(REPO / "train_configs" / "cp2.toml"),
            "TRAIN_FILE": "tests.data_faults",
            "PYTHONPATH": str(REPO),
            FAULT_ENV: "short_grid",
        },
        [
            str(RUN_TRAIN),
            f"--dump_folder={tmp_path / 'dump'}",
            *UNPACKED,
            "--training.steps=3",
            f"--parallelism.context_parallel_vision={vision}",
        ],
        tmp_path / "run.log",
        timeout=TIMEOUT_S,
        echo=False,
    )
    log = (tmp_path / "run.log").read_text()
    assert not record.timed_out and record.returncode not in (0, None), log[-3000:]
    for rank in (0, 1):
        errors = [
            line
            for line in log.splitlines()
            if line.startswith(f"[rank{rank}]:") and "Multimodal batch mismatch" in line
        ]
        assert errors, f"rank {rank} did not report the mismatch:\n{log[-3000:]}"
        assert "image 0's grid" in errors[0] and "pixels past them" in errors[0]
    assert "step:  2" not in log
