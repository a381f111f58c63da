"""Real 2-rank PP launches of user splits: vision on stage 0, or all ranks fail."""

import json
import re

import pytest

from torchtitan_ext.muse_glimmer import VISION_MODULE_FQNS
from torchtitan_ext.tools.parity import RUN_TRAIN, launch_run

from ..parity_suites import FP32
from ..training_runs import REPO, run_train
from ..unit.test_hostile_config import FOUR_PARTS
from ..unit.test_pipeline_split import FIRST, LAST

TIMEOUT_S = 600


def _split_toml(path, first, last):
    def fqns(part):
        return ", ".join(f'"{fqn}"' for fqn in part)

    path.write_text(
        (REPO / "train_configs" / "pp2.toml").read_text()
        + f"module_fqns_per_model_part = [[{fqns(first)}], [{fqns(last)}]]\n"
    )
    return path


def _assert_raised_on_every_rank(log: str, message: str) -> None:
    """Each of the 2 ranks raised ``message``, or torchrun stopped it first.

    The first rank to raise ends the job: torchrun may SIGTERM the other one
    before it reaches the check (seen in CI), which runs the same on every rank.
    """
    raised = {
        rank
        for rank in (0, 1)
        if any(
            line.startswith(f"[rank{rank}]:") and message in line
            for line in log.splitlines()
        )
    }
    sigterm = r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: -15 "
    stopped = {int(rank) for rank in re.findall(sigterm, log)}
    assert raised and raised | stopped == {0, 1}, log[-3000:]


def test_pp2_run_places_omitted_vision_modules(tmp_path):
    toml = _split_toml(tmp_path / "split.toml", FIRST, LAST)
    args = ["--training.steps=2", "--training.seq_len=256", FP32]
    run_train(
        tmp_path,
        "placed",
        str(toml),
        args,
        timeout_s=TIMEOUT_S,
        env={"LOG_RANK": "0,1"},
    )
    log = (tmp_path / "placed.log").read_text()
    assert f"Placing {list(VISION_MODULE_FQNS)} on the first pipeline stage" in log
    assert "step:  2" in log


def test_pp2_run_rejects_vision_on_stage_1_on_every_rank(tmp_path):
    toml = _split_toml(tmp_path / "split.toml", FIRST, ["vision_encoder", *LAST])
    with pytest.raises(pytest.fail.Exception):
        run_train(
            tmp_path,
            "rejected",
            str(toml),
            ["--training.steps=1", "--training.seq_len=256"],
            timeout_s=TIMEOUT_S,
            env={"LOG_RANK": "0,1"},
            forked=False,  # reads torchrun's report of the ranks it stopped
        )
    log = (tmp_path / "rejected.log").read_text()
    _assert_raised_on_every_rank(log, "puts 'vision_encoder' in part 1")


def test_bad_pipeline_split_exits_fast_on_every_rank(tmp_path):
    """One real 2-rank launch: PP2, 1F1B, a 4-part split, 4 microbatches.

    Upstream starts training and fails inside step 1 (rank 1 aborts, rank 0
    sees gloo's "Connection reset by peer"); now both ranks raise at start-up.
    """
    config_file = tmp_path / "split.toml"
    config_file.write_text(
        (REPO / "train_configs" / "pp2.toml").read_text()  # ends in [parallelism]
        + f"module_fqns_per_model_part = {json.dumps(FOUR_PARTS)}\n"
    )
    record = launch_run(
        "pp2_1f1b_4_parts",
        {"NGPU": "2", "LOG_RANK": "0,1", "CONFIG_FILE": str(config_file)},
        [
            str(RUN_TRAIN),
            f"--dump_folder={tmp_path / 'dump'}",
            "--training.local_batch_size=4",
        ],
        tmp_path / "run.log",
        timeout=120,
        echo=False,
    )
    log = (tmp_path / "run.log").read_text()
    assert not record.timed_out, log[-2000:]
    assert record.returncode not in (0, None), log[-2000:]
    message = (
        "ValueError: parallelism.module_fqns_per_model_part has 4 parts; "
        "pipeline_parallel_schedule='1F1B' runs one stage per rank"
    )
    _assert_raised_on_every_rank(log, message)
    assert "Training starts" not in log
