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

from ..faults import FAULT_ENV, RANK_ENV
from ..parity_suites import (
    CP_BOUNDS,
    FP32,
    FULL,
    GRAD_NORM_TOL,
    LOSS_TOL,
    PACKED,
    STEPS,
    TIMEOUT_S,
    assert_pair,
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
    "1rank": toml_spec("packed.toml"),
    "cp2": toml_spec("cp2.toml"),
    "tp2_sp": toml_spec("tp2_sp.toml"),
    "fsdp2": toml_spec("fsdp2.toml"),
    "fsdp2_cp2": toml_spec("fsdp2_cp2.toml"),
    "fsdp2_cp2_sharded_vision": toml_spec(
        "fsdp2_cp2.toml", "--parallelism.context_parallel_vision sharded"
    ),
    # FSDP2 with two accumulated microbatches per rank: FSDP2xCP2's control.
    "fsdp2_grad_accum": toml_spec(
        "fsdp2.toml", "--training.local_batch_size 1 --training.global_batch_size 4"
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
    note = f"; control max|dgrad_norm|={control.max_dgrad_norm:.3e}"
    assert_pair(f"{baseline} vs {job}", pair, moments, note)


@pytest.mark.parametrize(
    ("source", "job"),
    [
        ("1rank", "cp2"),
        ("cp2", "tp2_sp"),
        ("fsdp2", "fsdp2_cp2"),
        ("fsdp2_cp2", "fsdp2_cp2_sharded_vision"),
        *(
            [("fsdp2_cp2", "fsdp2"), ("fsdp2_cp2_sharded_vision", "fsdp2_cp2")]
            if FULL
            else []
        ),
    ],
)
def test_resume_across_topologies(runs, source, job):
    """A checkpoint continues under another topology as that topology's own run.

    DCP reshards model and optimizer state; the dataloader position carries over
    when the data-parallel degree does not change (torchtitan cannot reshard it),
    so FSDP2 pairs with FSDP2 x CP2, and the other jobs have one data rank. The
    vision modes share their checkpoints: replicated continues as sharded and
    back. CI (``FULL`` off) resumes one way only: CP2 into TP2+SP already takes
    a CP checkpoint out of CP.
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


def _start_two_nodes(
    runs, dump: Path, args: list[str], env: dict[str, str] | None = None
) -> tuple[list[threading.Thread], dict[int, RunRecord]]:
    """``run_train.sh`` CP2 with NNODES=2, started once per node on loopback.

    ``env``: more ``run_train.sh`` variables for both nodes (a fault).
    """
    endpoint = f"localhost:{_free_port()}"
    records: dict[int, RunRecord] = {}

    def node(rank: int) -> None:
        node_env = {"NNODES": "2", "NODE_RANK": str(rank), "RDZV_ENDPOINT": endpoint}
        records[rank] = launch_run(
            f"{dump.name}_node{rank}",
            {**JOBS["cp2"].job_env(ngpu=1), **(env or {}), **node_env},
            [str(RUN_TRAIN), f"--dump_folder={dump}", *args],
            runs.out / f"{dump.name}_node{rank}.log",
            timeout=TIMEOUT_S,
            echo=False,
        )

    nodes = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in nodes:
        thread.start()
    return nodes, records


def test_two_nodes_on_loopback_match_one_node(runs):
    """``run_train.sh`` with NNODES=2, started twice: CP2 across the two nodes."""
    reference = _scalars(runs.uninterrupted("cp2"))
    dump = runs.out / "cp2_two_nodes"
    nodes, records = _start_two_nodes(
        runs, dump, [*_TRAIN_ARGS, *_load_args(runs.seed, model_only=True)]
    )
    for thread in nodes:
        thread.join()
    assert all(record.ok for record in records.values()), records
    # Node 1 shows its local rank 0, global rank 1: it trained too.
    node1_log = Path(records[1].log_path).read_text()
    assert re.search(r"step:\s+1\b", node1_log), "node 1 did not train"
    _assert_bitwise(_scalars(dump), reference, list(range(1, STEPS + 1)))


def _pids(dump: Path, env_entry: str) -> list[int]:
    """The processes of the job dumping to ``dump`` with ``env_entry`` set."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if str(dump).encode() in cmdline and env_entry.encode() in environ:
            pids.append(int(proc.name))
    return pids


def test_rank_killed_in_a_save_ends_job_and_the_last_complete_checkpoint_resumes(
    runs,
):
    """Rank 1 of a CP2 job dies in the step-2*SAVE_STEP save, its shard written.

    The job must exit non-zero well before the collectives' timeout, leaving a
    step folder without ``.metadata``; the same command, restarted, must resume
    from the step-SAVE_STEP checkpoint (never the cut one), bitwise as the
    uninterrupted run, and complete the cut checkpoint.
    """
    reference = _scalars(runs.uninterrupted("cp2"))
    dump = runs.out / "cp2_killed"
    cut = dump / "checkpoint" / f"step-{2 * SAVE_STEP}"
    record: list[RunRecord] = []
    job = threading.Thread(
        target=lambda: record.append(
            launch_run(
                "cp2_killed",
                {
                    **JOBS["cp2"].job_env(),
                    "TRAIN_FILE": "tests.faults",
                    FAULT_ENV: "kill_in_save",
                    RANK_ENV: "1",
                },
                [
                    str(RUN_TRAIN),
                    f"--dump_folder={dump}",
                    *_TRAIN_ARGS,
                    *_load_args(runs.seed, model_only=True),
                ],
                runs.out / "cp2_killed.log",
                timeout=TIMEOUT_S,
                echo=False,
            )
        )
    )
    job.start()
    while not list(cut.glob("__1_*.distcp")) and job.is_alive():
        time.sleep(0.01)
    killed_at = time.monotonic()
    job.join()
    exited_after_s = time.monotonic() - killed_at
    print(f"rank 1 died saving {cut.name}; the job exited {exited_after_s:.1f} s later")
    assert not record[0].timed_out and record[0].returncode != 0, record[0]
    assert "Signal 9 (SIGKILL) received by PID" in Path(record[0].log_path).read_text()
    assert exited_after_s < TRAIN_TIMEOUT_S / 2
    assert list(cut.glob("*.distcp")) and not (cut / ".metadata").exists()

    Path(record[0].log_path).rename(runs.out / "cp2_killed.first.log")
    shutil.rmtree(dump / "tb")
    runs.train(dump.name, "cp2")  # the same command, restarted
    log = (runs.out / "cp2_killed.log").read_text()
    assert f"Loading the checkpoint from {cut.parent / f'step-{SAVE_STEP}'}" in log
    _assert_bitwise(_scalars(dump), reference, RESUMED_STEPS)
    assert (cut / ".metadata").is_file()


def _stop_a_node(runs, victim: int, how: signal.Signals) -> tuple[RunRecord, float]:
    """A two-node CP2 job whose node ``victim`` gets ``how`` at step 2.

    SIGSTOP freezes it with its sockets open, as a node that lost power or its
    network leaves them: no peer hears of it. SIGKILL kills its processes, whose
    sockets the kernel closes. The other node's record and seconds from the
    signal to its exit.
    """
    dump = runs.out / f"cp2_node{victim}_{how.name}"
    nodes, records = _start_two_nodes(runs, dump, ["--training.steps=100000", FP32])
    survivor = 1 - victim
    survivor_log = runs.out / f"{dump.name}_node{survivor}.log"
    while nodes[survivor].is_alive() and not re.search(
        r"step:\s+2\b", survivor_log.read_text() if survivor_log.exists() else ""
    ):
        time.sleep(0.1)
    stopped = _pids(dump, f"NODE_RANK={victim}")
    for pid in stopped:
        os.kill(pid, how)
    stopped_at = time.monotonic()
    nodes[survivor].join()
    exited_after_s = time.monotonic() - stopped_at
    for pid in stopped:
        if how != signal.SIGKILL:
            os.kill(pid, signal.SIGKILL)
    nodes[victim].join()
    return records[survivor], exited_after_s


def test_a_dead_or_frozen_node_ends_the_job_on_the_other_node_within_a_minute(runs):
    """Three two-node jobs at once: node 1 frozen, node 0 (the store's host)
    frozen, node 1 killed.

    Without the node watchdog the other node of a frozen one waits in a
    collective for ``comm.train_timeout_seconds`` (100 s) after step 1, 300 s
    before; a killed node's closed sockets end it at once either way.
    """
    cases = [(1, signal.SIGSTOP), (0, signal.SIGSTOP), (1, signal.SIGKILL)]
    results: dict[tuple[int, signal.Signals], tuple[RunRecord, float]] = {}
    jobs = [
        threading.Thread(
            target=lambda c=case: results.__setitem__(c, _stop_a_node(runs, *c))
        )
        for case in cases
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    for (victim, how), (record, exited_after_s) in results.items():
        print(f"node {victim} {how.name}: the other ended in {exited_after_s:.1f} s")
        assert record.returncode != 0 and not record.timed_out, record
        if how == signal.SIGSTOP:
            log = Path(record.log_path).read_text()
            assert f"Node watchdog on node {1 - victim}: " in log
        assert exited_after_s < 60
