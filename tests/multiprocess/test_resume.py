"""Checkpoints resume exactly, across topologies and with torchtitan's own model.

Every run starts from the session's seed checkpoint (1 rank, conftest), trains
``STEPS`` packed steps (fp32, deterministic) and saves a full DCP checkpoint
(model, optimizer, lr scheduler, dataloader position, step) at ``SAVE_STEP``
and at the end. A resumed run loads the step-``SAVE_STEP`` checkpoint and
trains to ``STEPS``; its steps after ``SAVE_STEP`` are compared with an
uninterrupted run. The two-node and killed-rank tests compare CP2 launched
another way with the CP2 run bitwise over every step, so they are the
determinism check too. TP2xCP2xPP2+SP resumes in ``test_parity_cp.py``, on its
suite run.

``TORCHTITAN_EXT_PARITY_OUT`` keeps the runs (folder ``resume``).
"""

import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from torchtitan_ext.tools.parity import (
    RUN_TRAIN,
    RunRecord,
    RunScalars,
    compare,
    compare_first_moments,
    launch_run,
    read_tb_scalars,
)

from ..parity_suites import (
    CP_BOUNDS,
    GRAD_NORM_TOL,
    LOSS_TOL,
    PACKED,
    STEPS,
    TIMEOUT_S,
    cp_step_tolerances,
    toml_spec,
    upstream_spec,
)
from ..training_runs import checkpoint_path, checkpoint_tensors, run_job

# The first moments are compared after this step (``CP_BOUNDS``'s moment step).
SAVE_STEP = CP_BOUNDS["moment_step"]
RESUMED_STEPS = list(range(SAVE_STEP + 1, STEPS + 1))
# FSDP2 x CP2 against FSDP2 at the late steps: 8x the control's running max.
# Measured over 10 steps: |dgrad_norm| at most 5.96e-7 (step 8, ~10 ulps of
# the grad norm) against the control's 1.19e-7, a ratio of 5: CP's chunked
# attention reorders sums that two accumulated microbatches leave alone. The
# packed suite's pairs stay within 2x of theirs (``CP_BOUNDS``' 4x).
FSDP2_CONTROL_FACTOR = 8.0
# A rank's death must end the job well within the collectives' timeout.
TRAIN_TIMEOUT_S = 120

JOBS = {
    "1rank": toml_spec("packed.toml", 1),
    "cp2": toml_spec("cp2.toml", 2),
    "tp2_sp": toml_spec("tp2_sp.toml", 2),
    "fsdp2": toml_spec("fsdp2.toml", 2),
    "fsdp2_cp2": toml_spec("fsdp2_cp2.toml", 4),
    "fsdp2_cp2_sharded_vision": toml_spec(
        "fsdp2_cp2.toml", 4, "--parallelism.context_parallel_vision sharded"
    ),
    # FSDP2 with two accumulated microbatches per rank: FSDP2xCP2's control.
    "fsdp2_grad_accum": toml_spec(
        "fsdp2.toml", 2, "--training.local_batch_size 1 --training.global_batch_size 4"
    ),
}
_TRAIN_ARGS = [
    "--training.mixed_precision_param=float32",
    "--debug.deterministic",
    "--debug.seed=42",
    "--metrics.enable_tensorboard",
    "--metrics.log_freq=1",
    "--metrics.save_tb_folder=tb",
    f"--training.steps={STEPS}",
    f"--comm.train_timeout_seconds={TRAIN_TIMEOUT_S}",
    "--checkpoint.enable",
    f"--checkpoint.interval={SAVE_STEP}",
    "--checkpoint.no-last_save_model_only",
]


def _load_args(path: Path, *, model_only: bool) -> list[str]:
    return [
        f"--checkpoint.initial_load_path={path}",
        "--checkpoint.initial_load_model_only"
        if model_only
        else "--checkpoint.no-initial_load_model_only",
    ]


class _Runs:
    """The runs of this module, each trained once, on first use."""

    def __init__(self, out: Path, assets, seed: Path) -> None:
        self.out = out
        self.seed = seed
        self.jobs = {**JOBS, "upstream": upstream_spec(assets, 1, PACKED)}
        self._dumps: dict[str, Path] = {}

    def dump(self, name: str, make: Callable[[], Path]) -> Path:
        if name not in self._dumps:
            self._dumps[name] = make()
        return self._dumps[name]

    def train(self, name: str, job: str, load: list[str] | None = None) -> Path:
        """``job`` trained from the seed (or as ``load`` says); its dump folder."""
        load = load or _load_args(self.seed, model_only=True)
        return self.dump(
            name,
            lambda: run_job(
                self.out,
                name,
                self.jobs[job],
                [*_TRAIN_ARGS, *load],
                timeout_s=TIMEOUT_S,
            ),
        )

    def uninterrupted(self, job: str) -> Path:
        return self.train(job, job)

    def resumed(self, job: str, source: str) -> Path:
        """``job`` continued from ``source``'s step-SAVE_STEP checkpoint."""
        saved = checkpoint_path(self.uninterrupted(source), SAVE_STEP)
        load = _load_args(saved, model_only=False)
        return self.train(f"{job}_from_{source}", job, load)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_assets, seed_checkpoint) -> _Runs:
    keep = os.environ.get("TORCHTITAN_EXT_PARITY_OUT")
    out = Path(keep) / "resume" if keep else tmp_path_factory.mktemp("resume")
    out.mkdir(parents=True, exist_ok=True)
    return _Runs(out, embedded_assets, seed_checkpoint)


def _scalars(dump: Path) -> RunScalars:
    return read_tb_scalars(dump / "tb")


def _assert_bitwise(test: RunScalars, reference: RunScalars, steps: list[int]):
    got = [(test.loss[s], test.grad_norm[s]) for s in steps]
    want = [(reference.loss[s], reference.grad_norm[s]) for s in steps]
    assert sorted(test.loss) == steps and got == want, (got, want)


def _assert_close(test: RunScalars, reference: RunScalars, steps: list[int]):
    assert sorted(test.loss) == steps
    dloss = max(abs(test.loss[s] - reference.loss[s]) for s in steps)
    dgrad = max(abs(test.grad_norm[s] - reference.grad_norm[s]) for s in steps)
    print(f"max|dloss|={dloss:.3e} max|dgrad_norm|={dgrad:.3e}")
    assert dloss <= LOSS_TOL and dgrad <= GRAD_NORM_TOL, (dloss, dgrad)


def test_uninterrupted_plugin_is_bitwise_upstream(runs):
    """The 1-rank runs resumed from are torchtitan's job and the plug-in's, bitwise.

    The CP pairs (CP2 vs 1 rank, FSDP2xCP2 vs FSDP2) are judged in
    ``test_parity_cp.py``, by per-step bounds and first moments.
    """
    got, want = (_scalars(runs.uninterrupted(job)) for job in ("upstream", "1rank"))
    _assert_bitwise(got, want, list(range(1, STEPS + 1)))


@pytest.mark.parametrize(
    ("baseline", "job", "control_factor"),
    [
        ("fsdp2", "fsdp2_cp2", FSDP2_CONTROL_FACTOR),
        ("fsdp2", "fsdp2_cp2_sharded_vision", FSDP2_CONTROL_FACTOR),
        ("fsdp2_cp2", "fsdp2_cp2_sharded_vision", CP_BOUNDS["control_factor"]),
    ],
)
def test_fsdp2_cp2_matches_its_baseline(runs, baseline, job, control_factor):
    """FSDP2 x CP2 vs FSDP2 (two data ranks), and sharded vs replicated vision.

    By the CP suites' bounds, on the runs resumed from; the late steps are
    bounded by FSDP2 with two accumulated microbatches, the same math
    reordered.
    """
    fsdp2 = _scalars(runs.uninterrupted("fsdp2"))
    control = compare(
        fsdp2,
        _scalars(runs.uninterrupted("fsdp2_grad_accum")),
        loss_tol=LOSS_TOL,
        grad_norm_tol=GRAD_NORM_TOL,
        expected_steps=STEPS,
    )
    assert control.passed, control.failures
    loss_tol, grad_norm_tol = cp_step_tolerances(control.rows, control_factor)
    pair = compare(
        _scalars(runs.uninterrupted(baseline)),
        _scalars(runs.uninterrupted(job)),
        loss_tol=loss_tol,
        grad_norm_tol=grad_norm_tol,
        expected_steps=STEPS,
    )
    moments = compare_first_moments(
        checkpoint_path(runs.uninterrupted(baseline), SAVE_STEP),
        checkpoint_path(runs.uninterrupted(job), SAVE_STEP),
        tol=CP_BOUNDS["moment_tol"],
    )
    print(
        f"{baseline} vs {job}: max|dloss|={pair.max_dloss:.3e} "
        f"max|dgrad_norm|={pair.max_dgrad_norm:.3e}, first moments max "
        f"{moments.max_error:.3e}; control max|dgrad_norm|={control.max_dgrad_norm:.3e}"
    )
    assert pair.passed, pair.failures
    assert moments.passed, moments.failures


@pytest.mark.parametrize(
    ("source", "job"),
    [
        ("1rank", "cp2"),
        ("cp2", "tp2_sp"),
        ("fsdp2", "fsdp2_cp2"),
        ("fsdp2_cp2", "fsdp2"),
        ("fsdp2_cp2", "fsdp2_cp2_sharded_vision"),
        ("fsdp2_cp2_sharded_vision", "fsdp2_cp2"),
    ],
)
def test_resume_across_topologies(runs, source, job):
    """A checkpoint continues under another topology as that topology's own run.

    DCP reshards model and optimizer state; the dataloader position carries over
    when the data-parallel degree does not change (torchtitan cannot reshard it),
    so FSDP2 pairs with FSDP2 x CP2, and the other jobs have one data rank. The
    vision modes share their checkpoints: replicated continues as sharded and
    back.
    """
    resumed = _scalars(runs.resumed(job, source))
    _assert_close(resumed, _scalars(runs.uninterrupted(job)), RESUMED_STEPS)


@pytest.mark.parametrize(
    ("source", "job"), [("upstream", "1rank"), ("1rank", "upstream")]
)
def test_upstream_checkpoints_interchange(runs, source, job):
    """torchtitan's muse_glimmer and the plug-in read each other's checkpoints.

    Same keys, bitwise the same state after the same steps, and a run continued
    by the other one is bitwise the uninterrupted run.
    """
    saved = {
        name: checkpoint_tensors(checkpoint_path(runs.uninterrupted(name), SAVE_STEP))
        for name in (source, job)
    }
    assert saved[source].keys() == saved[job].keys()
    unequal = [k for k, v in saved[source].items() if not v.equal(saved[job][k])]
    assert not unequal, unequal[:5]
    resumed = _scalars(runs.resumed(job, source))
    _assert_bitwise(resumed, _scalars(runs.uninterrupted(source)), RESUMED_STEPS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_one_node(runs):
    """``run_train.sh`` with NNODES=2, started twice: CP2 across the two nodes."""
    reference = _scalars(runs.uninterrupted("cp2"))
    dump = runs.out / "cp2_two_nodes"
    endpoint = f"localhost:{_free_port()}"
    records: dict[int, RunRecord] = {}

    def node(rank: int) -> None:
        env = {"NNODES": "2", "NODE_RANK": str(rank), "RDZV_ENDPOINT": endpoint}
        records[rank] = launch_run(
            f"cp2_node{rank}",
            {**JOBS["cp2"].job_env(ngpu=1), **env},
            [
                str(RUN_TRAIN),
                f"--dump_folder={dump}",
                *_TRAIN_ARGS,
                *_load_args(runs.seed, model_only=True),
            ],
            runs.out / f"cp2_node{rank}.log",
            timeout=TIMEOUT_S,
            echo=False,
        )

    nodes = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join()
    assert all(record.ok for record in records.values()), records
    # Node 1 shows its local rank 0, global rank 1: it trained too.
    node1_log = Path(records[1].log_path).read_text()
    assert re.search(r"step:\s+1\b", node1_log), "node 1 did not train"
    _assert_bitwise(_scalars(dump), reference, list(range(1, STEPS + 1)))


def _worker_pid(dump: Path, rank: int) -> int | None:
    """The training process of ``rank`` whose command line names ``dump``."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if str(dump).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_killed_rank_ends_job_and_last_checkpoint_resumes_bitwise(runs):
    """Rank 1 of a CP2 job is killed after the step-SAVE_STEP checkpoint.

    The job must exit non-zero well before the collectives' timeout, and the
    same command then resumes from that checkpoint (the job's own restart path)
    bitwise as the uninterrupted run.
    """
    reference = _scalars(runs.uninterrupted("cp2"))
    dump = runs.out / "cp2_killed"
    argv = [
        str(RUN_TRAIN),
        f"--dump_folder={dump}",
        *_TRAIN_ARGS,
        *_load_args(runs.seed, model_only=True),
    ]
    record: list[RunRecord] = []
    job = threading.Thread(
        target=lambda: record.append(
            launch_run(
                "cp2_killed",
                JOBS["cp2"].job_env(),
                argv,
                runs.out / "cp2_killed.log",
                timeout=TIMEOUT_S,
                echo=False,
            )
        )
    )
    job.start()
    saved = dump / "checkpoint" / f"step-{SAVE_STEP}" / ".metadata"
    while not saved.is_file() and job.is_alive():
        time.sleep(0.01)
    pid = _worker_pid(dump, 1)
    assert pid is not None and job.is_alive(), "the job ended before it was killed"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    job.join()
    exited_after_s = time.monotonic() - killed_at
    print(f"killed rank 1 (pid {pid}); the job exited {exited_after_s:.1f} s later")
    assert not record[0].timed_out and record[0].returncode != 0, record[0]
    assert exited_after_s < TRAIN_TIMEOUT_S / 2
    assert not (dump / "checkpoint" / f"step-{STEPS}").exists()

    Path(record[0].log_path).rename(runs.out / "cp2_killed.first.log")
    shutil.rmtree(dump / "tb")
    runs.train(dump.name, "cp2")  # the same command, restarted
    log = (runs.out / "cp2_killed.log").read_text()
    assert f"Loading the checkpoint from {saved.parent}" in log
    _assert_bitwise(_scalars(dump), reference, RESUMED_STEPS)
