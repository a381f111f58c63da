"""Bad data under CP2: a bad sample is skipped and training goes on; a bad batch,
which cannot be half skipped, stops every CP rank with one named error, no hang."""

import math

import pytest

from torchtitan_ext.tools.parity import RUN_TRAIN, launch_run, read_tb_scalars

from ..faults import FAULT_ENV, SAMPLE_ENV
from ..parity_suites import FP32
from ..training_runs import REPO, run_train
from ..unit.test_validator import dataset_with_stray_placeholder

TIMEOUT_S = 300
UNPACKED = ["--dataloader.packing_buffer_size=0", "--training.seq_len=256"]
VALIDATION = ["--validator.enable", "--validator.freq=2", "--validator.steps=1"]


def test_bad_samples_are_skipped_by_name_and_a_restart_passes_them(tmp_path):
    """Sample 0005's caption spells a placeholder, sample 0006 has a NaN pixel.

    Two samples a step: both are read at step 3, after the step-2 checkpoint.
    torchtitan 0.3.0 (and the plug-in before) ended the run at the first and
    let the second poison an update; a restart from the checkpoint hit them
    again. Here both CP ranks skip both by name, count them and train on, and
    the job resumed from step 2 skips them again and trains steps 3 and 4
    bitwise as the uninterrupted one. Validation, after steps 2 and 4, reads
    samples 0000 and 0001 and checks its batches as training does.
    """
    dataset = dataset_with_stray_placeholder(tmp_path / "data", key="0005")
    args = [
        f"--dataloader.dataset_path={dataset}",
        *UNPACKED,
        "--training.steps=4",
        FP32,
        "--debug.deterministic",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq=1",
        "--checkpoint.enable",
        "--checkpoint.interval=2",
        *VALIDATION,
    ]
    env = {
        "LOG_RANK": "0,1",
        "TRAIN_FILE": "tests.faults",
        "PYTHONPATH": str(REPO),
        FAULT_ENV: "nan_pixel",
        SAMPLE_ENV: "0006",
    }
    first = run_train(tmp_path, "bad", "cp2.toml", args, timeout_s=TIMEOUT_S, env=env)
    saved = first / "checkpoint" / "step-2"
    resumed = run_train(
        tmp_path,
        "resumed",
        "cp2.toml",
        [
            *args,
            f"--checkpoint.initial_load_path={saved}",
            "--checkpoint.no-initial_load_model_only",
        ],
        timeout_s=TIMEOUT_S,
        env=env,
    )
    for name in ("bad", "resumed"):
        log = (tmp_path / f"{name}.log").read_text().splitlines()
        for rank in (0, 1):
            lines = [line for line in log if line.startswith(f"[rank{rank}]:")]
            skips = [line for line in lines if "Skipping sample" in line]
            assert len(skips) == 2, (name, rank, skips)
            assert (
                ":0005: its text 'txt' contains the special token string(s) "
                in (skips[0])
            )
            assert "['<|image_pad|>']" in skips[0]
            assert ":0006: pixel_values[0] has 1 non-finite values (NaN" in skips[1]
            assert any("step:  4" in line for line in lines), (name, rank)
            assert any("validate step:  4" in line for line in lines), (name, rank)
            assert any("skipped samples: 2 on dp rank 0" in line for line in lines)
    uninterrupted, restarted = (
        read_tb_scalars(dump / "tb") for dump in (first, resumed)
    )
    assert sorted(restarted.loss) == [3, 4]
    assert all(
        math.isfinite(uninterrupted.loss[step])
        and restarted.loss[step] == uninterrupted.loss[step]
        and restarted.grad_norm[step] == uninterrupted.grad_norm[step]
        for step in (3, 4)
    ), (uninterrupted, restarted)


@pytest.mark.parametrize("vision", ["replicated", "sharded"])
def test_a_grid_disagreeing_with_its_pixels_stops_every_cp_rank(tmp_path, vision):
    record = launch_run(
        f"short_grid_{vision}",
        {
            "NGPU": "2",
            "LOG_RANK": "0,1",
            "CONFIG_FILE": str(REPO / "train_configs" / "cp2.toml"),
            "TRAIN_FILE": "tests.faults",
            "PYTHONPATH": str(REPO),
            FAULT_ENV: "short_grid",
        },
        [
            str(RUN_TRAIN),
            f"--dump_folder={tmp_path / 'dump'}",
            *UNPACKED,
            "--training.steps=3",
            FP32,
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
