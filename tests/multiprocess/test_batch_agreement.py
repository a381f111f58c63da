"""The batch agreement check on real gloo ranks: who is grouped, who raises, and why."""

import re
import time
from datetime import datetime
from types import SimpleNamespace

import pytest
import torch
from torchtitan.config import CommConfig

from torchtitan_ext.muse_glimmer.batch_agreement import (
    BatchAgreement,
    batch_fingerprint,
)
from torchtitan_ext.tools.local_ranks import run_on_ranks
from torchtitan_ext.tools.parity import RUN_TRAIN, launch_run

from ..faults import FAULT_ENV, RANK_ENV
from ..jobs import toml_ranks
from ..parity_suites import FP32, FULL
from ..training_runs import REPO

TIMEOUT_S = 180  # a hang would run to it; the jobs end within a minute
SHARDED = ["--parallelism.context_parallel_vision", "sharded"]
# torchtitan's log lines and torchrun's failure summary both carry the time.
STAMP = re.compile(r"(\d{4}-\d\d-\d\d[ _]\d\d:\d\d:\d\d)")


def _batch(rows: int = 2) -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (rows, 16), generator=generator)
    return {
        "input": tokens,
        "pixel_values": torch.randn(3, 16, 12, generator=generator),
        "grid_thw": torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 4]]),
    }, tokens.roll(-1, dims=1)


def _dims(pp: int, batch: int, cp: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=pp * batch * cp * tp,
        pp=pp,
        dp_replicate=1,
        dp_shard=batch,
        cp=cp,
        tp=tp,
    )


COMM = CommConfig(init_timeout_seconds=60, train_timeout_seconds=2)


def _check(agreement: BatchAgreement, inputs: dict, labels: torch.Tensor) -> str | None:
    try:
        agreement.check(inputs, labels, "training step 2")
    except RuntimeError as error:
        return str(error)
    return None


def _on_rank() -> tuple[str | None, str | None]:
    import torch.distributed as dist

    rank = dist.get_rank()
    # FSDP2 x CP2: groups {0, 1} and {2, 3}; rank 3 has one pixel changed.
    inputs, labels = _batch()
    if rank >= 2:
        inputs["input"] = inputs["input"] + 1  # another data-parallel index's batch
    if rank == 3:
        inputs["pixel_values"][2, 0, 0] += 1e-3
    by_dp = _check(BatchAgreement(_dims(1, 2, 2, 1), COMM), inputs, labels)
    # PP2 x TP2: one group of 4; rank 1 dropped a row and its image.
    inputs, labels = _batch()
    if rank == 1:
        inputs, labels = _batch(1)
        inputs["grid_thw"] = inputs["grid_thw"][:2]
        inputs["pixel_values"] = inputs["pixel_values"][:2]
    by_pp_tp = _check(BatchAgreement(_dims(2, 1, 1, 2), COMM), inputs, labels)
    # CP4: after a first check, rank 3 never checks again (its node froze).
    agreement = BatchAgreement(_dims(1, 1, 4, 1), COMM)
    inputs, labels = _batch()
    agreement.check(inputs, labels, "training step 1")
    waited_s = None
    if rank != 3:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            agreement.check(inputs, labels, "training step 2")
        waited_s = time.monotonic() - start
    else:  # alive, its sockets open, but silent
        time.sleep(3 * COMM.train_timeout_seconds)
    return by_dp, by_pp_tp, waited_s


def test_every_rank_of_the_group_raises_the_same_named_error():
    results = run_on_ranks(_on_rank, 4, timeout_s=120)
    by_dp = [r[0] for r in results]
    assert by_dp[0] is None and by_dp[1] is None, by_dp  # their group agrees
    assert by_dp[2] is not None and by_dp[2] == by_dp[3]
    assert "Ranks [2, 3]" in by_dp[2] and "training step 2" in by_dp[2]
    assert "content rank 2: " in by_dp[2] and "tokens" not in by_dp[2], by_dp[2]
    by_pp_tp = [r[1] for r in results]
    assert len(set(by_pp_tp)) == 1 and by_pp_tp[0] is not None, by_pp_tp
    message = by_pp_tp[0]
    assert "Ranks [0, 1, 2, 3]" in message
    assert "tokens rank 0: 32, rank 1: 16, rank 2: 32, rank 3: 32" in message
    assert "images rank 0: 3, rank 1: 2, rank 2: 3, rank 3: 3" in message
    # After its first check the group waits comm.train_timeout_seconds (2 s
    # here), not the init timeout (60 s) nor gloo's default 30 minutes; the
    # bound leaves room for a loaded host (4 ranks on 2 busy cores).
    waited_s = [r[2] for r in results[:3]]
    assert all(s < COMM.init_timeout_seconds / 3 for s in waited_s), waited_s


def test_fingerprint_sees_one_value_of_any_input():
    base = batch_fingerprint(*_batch())
    assert torch.equal(base, batch_fingerprint(*_batch()))
    # One value changed: the grid moves "grids", any other "content".
    for name, index in [
        ("input", (1, 15)),
        ("labels", (0, 0)),
        ("pixel_values", (1, 3, 5)),
        ("grid_thw", (2, 1)),
    ]:
        inputs, labels = _batch()
        tensor = labels if name == "labels" else inputs[name]
        tensor[index] += 1
        changed = batch_fingerprint(inputs, labels) != base
        grid = name == "grid_thw"
        assert changed.tolist() == [False, False, grid, not grid], name


# job: TOML, options, the failing step. Rank 1 drops a sample: a CP
# rank in the CP2 jobs, the second TP rank of CP rank 0 in TP2 + CP2 + SP,
# pipeline stage 1 in PP2. Unpacked rows, one sample each: the first sample
# read after batch 1 is batch 2's (the packer's buffer would move it to a later
# step): step 2's, step 1's second microbatch in PP2, or with validation after
# every step, the first validation batch's. CI (``FULL`` off) leaves out sharded
# vision: the check runs before the forward, in either vision mode alike.
UNPACKED = ["--dataloader.packing_buffer_size", "0"]
VALIDATION = ["--validator.enable", "--validator.freq=1", "--validator.steps=1"]
DIVERGING_JOBS = {
    "cp2": ("cp2.toml", [], "training step 2"),
    "cp2_sharded_vision": ("cp2.toml", SHARDED, "training step 2"),
    "tp2_cp2_sp": ("tp2_cp2_sp.toml", [], "training step 2"),
    "pp2": ("pp2.toml", [], "training step 1"),
    "cp2_validation": ("cp2.toml", VALIDATION, "step 1's validation"),
}
if not FULL:
    DIVERGING_JOBS.pop("cp2_sharded_vision")


def _stamp(line: str) -> datetime:
    stamp = STAMP.search(line).group(1).replace("_", " ")
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")


@pytest.mark.parametrize("job", DIVERGING_JOBS)
def test_a_rank_that_drops_a_sample_stops_the_job_on_every_rank(tmp_path, job):
    """Every rank raises the same error naming the divergent batch, within 60 s."""
    toml, options, failing_step = DIVERGING_JOBS[job]
    ngpu = toml_ranks(toml, *options)
    record = launch_run(
        job,
        {
            "NGPU": str(ngpu),
            "LOG_RANK": ",".join(map(str, range(ngpu))),
            "CONFIG_FILE": str(REPO / "train_configs" / toml),
            "TRAIN_FILE": "tests.faults",
            "PYTHONPATH": str(REPO),
            FAULT_ENV: "drop_sample",
            RANK_ENV: "1",
        },
        [
            str(RUN_TRAIN),
            f"--dump_folder={tmp_path / 'dump'}",
            "--training.steps=3",
            FP32,
            *UNPACKED,
            *options,
        ],
        tmp_path / "run.log",
        timeout=TIMEOUT_S,
        echo=False,
    )
    log = (tmp_path / "run.log").read_text()
    assert not record.timed_out and record.returncode not in (0, None), log[-3000:]
    errors = {
        int(line[len("[rank") : line.index("]")]): line[line.index("RuntimeError") :]
        for line in log.splitlines()
        if line.startswith("[rank") and "hold different batches" in line
    }
    assert sorted(errors) == list(range(ngpu)), log[-3000:]
    (error,) = set(errors.values())
    ranks = list(range(ngpu))
    assert f"Ranks {ranks}" in error and f"at {failing_step}:" in error, error
    assert "content rank 0: " in error, error
    logged = [_stamp(line) for line in log.splitlines() if " - root - " in line]
    failed_at = max(_stamp(line) for line in log.splitlines() if "time      : " in line)
    waited_s = (failed_at - max(logged)).total_seconds()
    print(f"{job}: raised at {failing_step}, ended {waited_s:.0f} s after the last log")
    assert waited_s < 60
