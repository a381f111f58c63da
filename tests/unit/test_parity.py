"""The parity harness: comparison, TensorBoard reading, launching, suites.

Runs go through a stand-in for run_train.sh; real training runs of the
harness are exercised by the topology tests, through ``run_parity_suite``.
"""

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.tensorboard import SummaryWriter

from torchtitan_ext.tools.parity import (
    GRAD_NORM_TAG,
    LOSS_TAG,
    ParityCase,
    ParityError,
    RunScalars,
    RunSpec,
    compare,
    compare_first_moments,
    format_table,
    read_tb_scalars,
    run_parity,
    run_parity_suite,
    suite,
)
from torchtitan_ext.tools.parity.__main__ import build_parser, main, specs_from_args


def _f32(x: float) -> float:
    """``x`` rounded to float32, as TensorBoard stores a scalar."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _scalars(losses: list[float], grads: list[float] | None = None) -> RunScalars:
    grads = grads if grads is not None else [0.5 + i for i in range(len(losses))]
    return RunScalars(
        loss=dict(enumerate(losses, start=1)),
        grad_norm=dict(enumerate(grads, start=1)),
    )


# ---------------------------------------------------------------------------
# Comparison and table
# ---------------------------------------------------------------------------


def test_exact_pass_on_identical_values():
    a = _scalars([7.62, 7.61, 7.60])
    c = compare(a, _scalars([7.62, 7.61, 7.60]), exact=True, expected_steps=3)
    assert c.passed and not c.failures
    assert c.max_dloss == 0.0 and c.max_dgrad_norm == 0.0
    assert [r.step for r in c.rows] == [1, 2, 3]


def test_exact_fails_on_one_ulp():
    base = [7.62, 7.61, 7.60]
    test = [7.62, math.nextafter(7.61, math.inf), 7.60]
    c = compare(_scalars(base), _scalars(test), exact=True)
    assert not c.passed
    assert c.max_dloss == math.ulp(7.61)
    assert len(c.failures) == 1 and "step 2" in c.failures[0]
    # A 1-ulp difference is far inside the default tolerances.
    assert compare(_scalars(base), _scalars(test)).passed
    # The table shows it, it is not rounded away.
    assert f"{math.ulp(7.61):.8e}" in format_table(c)


def test_exact_fails_on_grad_norm_only():
    c = compare(
        _scalars([1.0, 2.0], [0.1, 0.2]),
        _scalars([1.0, 2.0], [0.1, math.nextafter(0.2, 0.0)]),
        exact=True,
    )
    assert not c.passed and c.max_dloss == 0.0
    assert "grad_norm differs" in c.failures[0]


@pytest.mark.parametrize(
    ("dloss", "dgrad", "passed"),
    [
        (9e-6, 9e-5, True),
        (1e-5, 1e-4, True),  # the bounds themselves pass
        (2e-5, 0.0, False),
        (0.0, 2e-4, False),
    ],
)
def test_tolerances(dloss, dgrad, passed):
    base = _scalars([8.0, 4.0], [1.0, 2.0])
    test = _scalars([8.0, 4.0 + dloss], [1.0, 2.0 + dgrad])
    c = compare(base, test, loss_tol=1e-5 * (1 + 1e-9), grad_norm_tol=1e-4 * 1.0001)
    assert c.passed is passed
    assert c.max_dloss == pytest.approx(dloss, abs=1e-15)
    assert c.max_dgrad_norm == pytest.approx(dgrad, abs=1e-15)
    assert not passed or not c.failures


def test_step_mismatch_fails_and_compares_common_steps():
    base = _scalars([1.0, 2.0, 3.0])
    test = _scalars([1.0, 2.0])
    c = compare(base, test)
    assert not c.passed
    assert any("step sets differ" in f and "[3]" in f for f in c.failures)
    assert [r.step for r in c.rows] == [1, 2]


def test_missing_expected_steps_fail():
    c = compare(_scalars([1.0, 2.0]), _scalars([1.0, 2.0]), expected_steps=3)
    assert not c.passed
    assert any("expected 1..3" in f for f in c.failures)


def test_no_common_steps_fail():
    c = compare(RunScalars(), RunScalars(), exact=True)
    assert not c.passed and c.rows == [] and c.max_dloss is None
    assert "max |dloss|      = n/a" in format_table(c)


def test_nan_on_one_side_fails():
    c = compare(_scalars([1.0, 2.0]), _scalars([1.0, math.nan]))
    assert not c.passed and c.max_dloss == math.inf
    assert "step 2: test loss is nan" in c.failures


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_on_both_sides_fails(exact, bad):
    """Two runs that diverged alike are not in parity, not even with --exact."""
    same_loss = compare(_scalars([1.0, bad]), _scalars([1.0, bad]), exact=exact)
    assert not same_loss.passed and same_loss.max_dloss == math.inf
    assert f"step 2: baseline loss is {bad!r}" in same_loss.failures
    assert f"step 2: test loss is {bad!r}" in same_loss.failures
    same_grad = compare(
        _scalars([1.0], [bad]), _scalars([1.0], [bad]), exact=exact, loss_tol=1.0
    )
    assert not same_grad.passed and same_grad.max_dgrad_norm == math.inf
    assert f"step 1: test grad_norm is {bad!r}" in same_grad.failures


def test_table_layout():
    c = compare(_scalars([7.6246233, 7.6]), _scalars([7.6246233, 7.6 + 1e-6]))
    lines = format_table(c).splitlines()
    assert "baseline loss" in lines[0] and "|dgrad_norm|" in lines[0]
    assert lines[2].split()[:3] == ["1", "7.62462330e+00", "7.62462330e+00"]
    assert lines[-2].startswith("max |dloss|") and lines[-1].startswith(
        "max |dgrad_norm|"
    )


# ---------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------


def _write_tb(run_dir: Path, losses: dict[int, float], grads: dict[int, float]):
    writer = SummaryWriter(str(run_dir))
    for step, v in losses.items():
        writer.add_scalar(LOSS_TAG, v, step)
        writer.add_scalar("loss_metrics/global_max_loss", v + 1, step)
    for step, v in grads.items():
        writer.add_scalar(GRAD_NORM_TAG, v, step)
    writer.close()


def test_read_tb_scalars(tmp_path):
    losses = {1: 7.62462, 2: 7.6244, 3: 7.62319}
    grads = {1: 0.1761, 2: 0.2125, 3: 0.2537}
    _write_tb(tmp_path / "tb_baseline" / "20260101-1200", losses, grads)
    s = read_tb_scalars(tmp_path / "tb_baseline")
    assert s.loss == {k: _f32(v) for k, v in losses.items()}
    assert s.grad_norm == {k: _f32(v) for k, v in grads.items()}


def test_read_tb_keeps_every_step(tmp_path):
    # EventAccumulator samples scalars by default; parity needs all of them.
    n = 10_500
    _write_tb(
        tmp_path / "tb" / "run",
        {s: float(s) for s in range(1, n + 1)},
        {s: 1.0 for s in range(1, n + 1)},
    )
    assert sorted(read_tb_scalars(tmp_path / "tb").loss) == list(range(1, n + 1))


def test_read_tb_errors(tmp_path):
    with pytest.raises(ParityError, match="does not exist"):
        read_tb_scalars(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ParityError, match="found 0: none"):
        read_tb_scalars(tmp_path / "empty")
    _write_tb(tmp_path / "two" / "a", {1: 1.0}, {1: 1.0})
    _write_tb(tmp_path / "two" / "b", {1: 1.0}, {1: 1.0})
    with pytest.raises(ParityError, match="found 2: a, b"):
        read_tb_scalars(tmp_path / "two")
    _write_tb(tmp_path / "nograd" / "a", {1: 1.0}, {})
    with pytest.raises(ParityError, match="'grad_norm' not found"):
        read_tb_scalars(tmp_path / "nograd")


# ---------------------------------------------------------------------------
# Launching, with a stand-in for run_train.sh
# ---------------------------------------------------------------------------

# Accepts run_train.sh's interface, writes a seed checkpoint or TB events.
# ``--fake.offset=X`` adds X to the loss at step 2 (``--fake.offset_step=N``: at
# step N instead), ``--fake.exit=N`` fails
# with exit code N; with FAKE_LAUNCH_LOG set, each launch appends its dump
# folder's name to that file.
FAKE_TRAIN = f"""\
#!{sys.executable}
import os, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
flags = set(sys.argv[1:])
dump = Path(args["--dump_folder"])
assert os.environ["NGPU"] and (os.environ.get("CONFIG_FILE") or os.environ["MODULE"])
print("fake run", os.environ["NGPU"], sys.argv[1:], flush=True)
if os.environ.get("FAKE_LAUNCH_LOG"):
    with open(os.environ["FAKE_LAUNCH_LOG"], "a") as f:
        f.write(dump.name + "\\n")
if "--fake.exit" in args:
    print("fake failure", flush=True)
    sys.exit(int(args["--fake.exit"]))
if "--checkpoint.create_seed_checkpoint" in flags:
    step0 = dump / args["--checkpoint.folder"] / "step-0"
    step0.mkdir(parents=True)
    (step0 / ".metadata").write_text("")
    sys.exit(0)
assert (Path(args["--checkpoint.initial_load_path"]) / ".metadata").is_file()
# tensorboard's own writer: importing torch would take seconds per run.
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
w = EventFileWriter(str(dump / args["--metrics.save_tb_folder"] / "20260101-1200"))
offset = float(args.get("--fake.offset", 0))
offset_step = int(args.get("--fake.offset_step", 2))
for step in range(1, int(args["--training.steps"]) + 1):
    values = {{
        "{LOSS_TAG}": 8.0 - step / 8 + (offset if step == offset_step else 0),
        "{GRAD_NORM_TAG}": 0.25 * step,
    }}
    for tag, v in values.items():
        value = Summary.Value(tag=tag, simple_value=v)
        w.add_event(Event(step=step, wall_time=0.0, summary=Summary(value=[value])))
w.close()
"""


def _script(tmp_path: Path, text: str, name: str = "fake_train.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_cli_exit_codes_with_fake_launcher(tmp_path, monkeypatch):
    fake = _script(tmp_path, FAKE_TRAIN)
    monkeypatch.setattr(suite, "RUN_TRAIN", fake)
    common = ["--steps", "3", "--quiet", "--test-ngpu", "2"]
    assert main([*common, "--output-dir", str(tmp_path / "a"), "--exact"]) == 0
    summary = json.loads((tmp_path / "a" / "test" / "parity.json").read_text())
    assert summary["passed"] and len(summary["per_step"]) == 3
    assert [r["name"] for r in summary["runs"]] == ["seed", "baseline", "test"]
    assert "NGPU=2" in summary["runs"][2]["command"]
    assert "--metrics.save_tb_folder=tb_test" in summary["runs"][2]["command"]
    assert "--training.mixed_precision_param float32" in summary["runs"][1]["command"]

    offset = ["--test-options=--fake.offset=1e-3"]
    out_b = str(tmp_path / "b")
    assert main([*common, *offset, "--output-dir", out_b, "--loss-tol", "1e-2"]) == 0
    out_c = str(tmp_path / "c")
    assert main([*common, *offset, "--output-dir", out_c]) == 1
    summary = json.loads((tmp_path / "c" / "test" / "parity.json").read_text())
    assert not summary["passed"] and "loss_tol" in summary["failures"][0]
    assert summary["max_dloss"] == pytest.approx(1e-3, rel=1e-3)
    assert (tmp_path / "c" / "test" / "parity.png").stat().st_size > 0
    # An output dir that holds files is refused: stale runs would be compared.
    with pytest.raises(SystemExit) as info:
        main([*common, "--output-dir", out_c])
    assert info.value.code == 2


def test_cli_specs():
    args = build_parser().parse_args(
        ["--baseline-config", "cfg_a", "--baseline-options", "--x 1"]
    )
    baseline, test = specs_from_args(args)
    assert (baseline.config, baseline.options) == ("cfg_a", "--x 1")
    assert (test.module, test.config, test.options) == (baseline.module, "cfg_a", "")
    assert test.job_env() == {
        "NGPU": "1",
        "MODULE": baseline.module,
        "CONFIG": "cfg_a",
    }


def test_config_file_spec(tmp_path, monkeypatch):
    (tmp_path / "job.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = RunSpec(config_file="job.toml", ngpu=2)
    assert spec.job_env() == {"NGPU": "2", "CONFIG_FILE": str(tmp_path / "job.toml")}
    with pytest.raises(ValueError, match="config file not found"):
        RunSpec(config_file="nope.toml")


def test_failed_run_shows_log_tail(tmp_path, capsys):
    fake = _script(tmp_path, "#!/bin/sh\necho 'boom: no such option' >&2\nexit 3\n")
    result = run_parity(RunSpec(), output_dir=tmp_path / "out", launcher=fake)
    assert not result.passed and result.png_path is None
    assert len(result.runs) == 1 and result.runs[0].returncode == 3
    assert "seed run failed with exit code 3" in result.failures[0]
    assert "boom: no such option" in capsys.readouterr().err
    summary = json.loads(result.json_path.read_text())
    assert "boom" in summary["runs"][0]["log_tail"]
    assert "boom" in (tmp_path / "out" / "seed.log").read_text()


def test_timeout_kills_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    fake = _script(tmp_path, f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    start = time.monotonic()
    result = run_parity(
        RunSpec(),
        output_dir=tmp_path / "out",
        launcher=fake,
        seed_checkpoint=False,
        timeout=2,
    )
    assert time.monotonic() - start < 60
    assert not result.passed and result.runs[0].timed_out
    assert "baseline run timed out" in result.failures[0]
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild dies with the group
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie nobody has reaped yet counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------------------
# Suites: one seed and one baseline for many tests
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_launcher(tmp_path, monkeypatch):
    """The stand-in launcher; ``launches()`` lists the runs it has started."""
    launch_log = tmp_path / "launches.txt"
    monkeypatch.setenv("FAKE_LAUNCH_LOG", str(launch_log))
    fake = _script(tmp_path, FAKE_TRAIN)

    def launches() -> list[str]:
        return launch_log.read_text().split() if launch_log.exists() else []

    return fake, launches


def test_suite_makes_seed_and_baseline_once(tmp_path, fake_launcher):
    fake, launches = fake_launcher
    out = tmp_path / "suite"
    results = run_parity_suite(
        RunSpec(),
        {
            "cp2": RunSpec(ngpu=2),
            "offset": ParityCase(
                RunSpec(options="--fake.offset=1e-3"), exact=False, loss_tol=1e-2
            ),
        },
        steps=3,
        exact=True,
        output_dir=out,
        launcher=fake,
    )
    assert launches() == ["seed", "baseline", "cp2", "offset"]
    assert list(results) == ["cp2", "offset"]
    assert all(r.passed for r in results.values())

    cp2 = results["cp2"]
    assert [r.name for r in cp2.runs] == ["seed", "baseline", "cp2"]
    assert [r.step for r in cp2.rows] == [1, 2, 3]
    assert cp2.max_dloss == 0.0 and cp2.max_dgrad_norm == 0.0
    assert all(math.isfinite(r.baseline_loss) for r in cp2.rows)
    # Both tests share the one seed and baseline run.
    assert results["offset"].runs[:2] == cp2.runs[:2]
    assert results["offset"].baseline is cp2.baseline
    assert results["offset"].max_dloss == pytest.approx(1e-3, rel=1e-3)

    for name, result in results.items():
        assert result.output_dir == out
        assert result.json_path == out / name / "parity.json"
        assert result.png_path == out / name / "parity.png"
        assert result.png_path.stat().st_size > 0
        assert (out / f"{name}.log").is_file()
        assert (out / name / f"tb_{name}").is_dir()
        summary = json.loads(result.json_path.read_text())
        assert summary["passed"] and summary["name"] == name
        assert len(summary["per_step"]) == 3
        for run in summary["runs"]:
            assert run["returncode"] == 0 and run["wall_s"] > 0
            assert Path(run["log_path"]).is_file()
        seed = out / "seed" / "checkpoint" / "step-0"
        assert f"--checkpoint.initial_load_path={seed}" in summary["runs"][2]["command"]
    cp2_summary = json.loads(cp2.json_path.read_text())
    assert cp2_summary["exact"] and "NGPU=2" in cp2_summary["runs"][2]["command"]
    # The override applies to its test only; the rest keep the suite's values.
    offset_summary = json.loads(results["offset"].json_path.read_text())
    assert not offset_summary["exact"] and offset_summary["loss_tol"] == 1e-2

    suite = json.loads((out / "suite.json").read_text())
    assert suite["passed"] and suite["failures"] == []
    assert [r["name"] for r in suite["runs"]] == ["seed", "baseline"]
    assert list(suite["tests"]) == ["cp2", "offset"]
    assert suite["tests"]["cp2"]["max_dloss"] == 0.0
    assert suite["tests"]["cp2"]["exact"] is True
    assert suite["tests"]["offset"]["max_dloss"] == pytest.approx(1e-3, rel=1e-3)
    assert suite["tests"]["offset"]["exact"] is False
    assert suite["tests"]["offset"]["png"] == str(out / "offset" / "parity.png")


def test_suite_loads_a_given_seed_checkpoint(tmp_path, fake_launcher):
    """Suites of one model share one seed: no seed run, every run loads it."""
    fake, launches = fake_launcher
    seed = tmp_path / "shared" / "checkpoint" / "step-0"
    seed.mkdir(parents=True)
    (seed / ".metadata").write_text("")
    out = tmp_path / "suite"
    results = run_parity_suite(
        RunSpec(),
        {"cp2": RunSpec(ngpu=2)},
        steps=2,
        exact=True,
        output_dir=out,
        launcher=fake,
        seed_checkpoint=seed,
    )
    assert launches() == ["baseline", "cp2"] and results["cp2"].passed
    load = f"--checkpoint.initial_load_path={seed}"
    assert all(load in run.command for run in results["cp2"].runs)
    suite = json.loads((out / "suite.json").read_text())
    assert suite["seed_checkpoint"] == str(seed)
    with pytest.raises(ValueError, match="no .metadata"):
        run_parity_suite(
            RunSpec(),
            {"cp2": RunSpec(ngpu=2)},
            output_dir=tmp_path / "other",
            launcher=fake,
            seed_checkpoint=tmp_path / "missing",
        )


def test_suite_failing_test_does_not_stop_the_others(tmp_path, fake_launcher):
    fake, launches = fake_launcher
    out = tmp_path / "suite"
    results = run_parity_suite(
        RunSpec(),
        {
            "broken": RunSpec(options="--fake.exit=3"),
            "drift": RunSpec(options="--fake.offset=1e-3"),
            "same": RunSpec(),
        },
        steps=2,
        output_dir=out,
        launcher=fake,
    )
    assert launches() == ["seed", "baseline", "broken", "drift", "same"]
    broken, drift, same = results.values()
    assert not broken.passed and broken.png_path is None and broken.rows == []
    assert broken.failures == [
        f"broken run failed with exit code 3 (log: {out / 'broken.log'})"
    ]
    summary = json.loads(broken.json_path.read_text())
    assert not summary["passed"] and "fake failure" in summary["runs"][2]["log_tail"]
    assert not drift.passed and "loss_tol" in drift.failures[0]
    assert drift.png_path is not None and drift.png_path.is_file()
    assert same.passed and same.max_dloss == 0.0
    suite = json.loads((out / "suite.json").read_text())
    assert not suite["passed"]
    assert {n: t["passed"] for n, t in suite["tests"].items()} == {
        "broken": False,
        "drift": False,
        "same": True,
    }
    assert suite["tests"]["broken"]["max_dloss"] is None
    assert suite["tests"]["broken"]["wall_s"] > 0


@pytest.mark.parametrize("failing", ["seed", "baseline"])
def test_suite_baseline_failure_fails_every_test(tmp_path, fake_launcher, failing):
    fake, launches = fake_launcher
    out = tmp_path / "suite"
    fail = "--fake.exit=5"
    results = run_parity_suite(
        RunSpec(options=fail if failing == "baseline" else ""),
        {"a": RunSpec(), "b": ParityCase(RunSpec(ngpu=2), exact=True)},
        steps=2,
        seed_options=fail if failing == "seed" else "",
        output_dir=out,
        launcher=fake,
    )
    assert launches() == ["seed", "baseline"][: 1 if failing == "seed" else 2]
    reason = f"{failing} run failed with exit code 5 (log: {out / failing}.log)"
    for name, result in results.items():
        assert not result.passed and result.failures == [reason]
        assert result.rows == [] and result.png_path is None
        assert result.runs[-1].name == failing
        summary = json.loads((out / name / "parity.json").read_text())
        assert summary["failures"] == [reason]
        assert "fake failure" in summary["runs"][-1]["log_tail"]
    suite = json.loads((out / "suite.json").read_text())
    assert not suite["passed"] and suite["failures"] == [reason]
    assert all(not t["passed"] and t["wall_s"] is None for t in suite["tests"].values())


@pytest.mark.parametrize(
    ("tests", "error"),
    [
        ({}, "at least one test"),
        ({"seed": RunSpec()}, "taken by the shared runs"),
        ({"baseline": RunSpec()}, "taken by the shared runs"),
        ({"a/b": RunSpec()}, "must match"),
        ({"": RunSpec()}, "must match"),
        ({"x": "--some.flag"}, "RunSpec or ParityCase"),
    ],
)
def test_suite_rejects_bad_tests_before_running(tmp_path, tests, error):
    out = tmp_path / "never"
    with pytest.raises((ValueError, TypeError), match=error):
        run_parity_suite(RunSpec(), tests, output_dir=out, launcher="/nonexistent")
    assert not out.exists()


# ---------------------------------------------------------------------------
# Per-step bounds from a control, and first moments
# ---------------------------------------------------------------------------


def test_per_step_tolerances_name_the_step():
    base = _scalars([8.0, 7.0, 6.0])
    test = _scalars([8.0, 7.0 + 2e-6, 6.0 + 2e-6])
    c = compare(base, test, loss_tol={1: 1e-6, 2: 1e-6, 3: 1e-5})
    assert not c.passed
    assert c.failures == ["step 2: |dloss| 2.00000000e-06 > loss_tol 1.000e-06"]
    missing = compare(base, test, loss_tol={1: 1.0, 2: 1.0})
    assert missing.failures == ["step 3: no loss_tol given for this step"]


def _loss_offset(offset: float, step: int) -> RunSpec:
    return RunSpec(options=f"--fake.offset={offset} --fake.offset_step={step}")


def test_control_bounds_the_late_steps(tmp_path, fake_launcher):
    """Tight bounds first; later, the control's running max times the factor."""
    fake, launches = fake_launcher
    results = run_parity_suite(
        RunSpec(),
        {
            # The control drifts 1e-3 at step 2; its running max bounds steps 3..4.
            "control": ParityCase(_loss_offset(1e-3, 2), loss_tol=1.0),
            "within": ParityCase(_loss_offset(3.5e-3, 4), control="control"),
            "beyond": ParityCase(_loss_offset(4.5e-3, 3), control="control"),
            "early": ParityCase(_loss_offset(1e-3, 2), control="control"),
            "short": ParityCase(_loss_offset(1e-3, 2), control="control", steps=2),
        },
        steps=4,
        tight_steps=2,
        control_factor=4.0,
        loss_tol=1e-5,
        output_dir=tmp_path / "suite",
        launcher=fake,
    )
    assert launches() == ["seed", "baseline", "control", "within", "beyond"] + [
        "early",
        "short",
    ]
    passed = {name: r.passed for name, r in results.items()}
    assert passed == {
        "control": True,
        "within": True,
        "beyond": False,
        "early": False,
        "short": False,
    }
    assert any(
        f.startswith("step 3: |dloss|") and "> loss_tol 4.000e-03" in f
        for f in results["beyond"].failures
    ), results["beyond"].failures
    assert any(
        f.startswith("step 2: |dloss|") and "> loss_tol 1.000e-05" in f
        for f in results["early"].failures
    )
    assert [r.step for r in results["short"].rows] == [1, 2]
    summary = json.loads(results["within"].json_path.read_text())
    assert summary["control"] == "control" and summary["tight_steps"] == 2


@pytest.mark.parametrize(
    ("tests", "error"),
    [
        ({"a": ParityCase(RunSpec(), control="b")}, "must be an earlier test"),
        ({"a": ParityCase(RunSpec(), steps=5)}, r"steps=5 must be in 1\.\.3"),
        (
            {
                "a": ParityCase(RunSpec(), steps=2),
                "b": ParityCase(RunSpec(), control="a"),
            },
            "trains 2 steps, fewer than its 3",
        ),
    ],
)
def test_suite_rejects_bad_controls_before_running(tmp_path, tests, error):
    with pytest.raises(ValueError, match=error):
        run_parity_suite(
            RunSpec(), tests, steps=3, output_dir=tmp_path / "x", launcher="/none"
        )
    assert not (tmp_path / "x").exists()


def _moments_checkpoint(path: Path, moments: dict[str, torch.Tensor]) -> Path:
    state = {
        "optimizer": {
            f"state.{name}": {"exp_avg": m, "exp_avg_sq": m * m}
            for name, m in moments.items()
        }
    }
    dcp.save(state, checkpoint_id=str(path))
    return path


def test_first_moments_relative_to_each_tensors_largest_entry(tmp_path):
    big = torch.linspace(-100.0, 100.0, 50)
    small = torch.linspace(-1e-3, 1e-3, 50)
    base = _moments_checkpoint(tmp_path / "base", {"big": big, "small": small})
    near = _moments_checkpoint(
        tmp_path / "near", {"big": big + 1e-3, "small": small + 1e-9}
    )
    c = compare_first_moments(base, near, tol=2e-5)
    keys = {"optimizer.state.big.exp_avg", "optimizer.state.small.exp_avg"}
    assert set(c.errors) == keys and c.passed
    assert c.errors["optimizer.state.big.exp_avg"] == pytest.approx(1e-5, rel=1e-3)
    assert c.errors["optimizer.state.small.exp_avg"] == pytest.approx(1e-6, rel=0.1)

    # One entry of the small tensor off by 1% of its scale: invisible in
    # absolute terms next to the big tensor, flagged relative to its own.
    off = small.clone()
    off[7] += 1e-5
    one = _moments_checkpoint(tmp_path / "one", {"big": big, "small": off})
    c = compare_first_moments(base, one, tol=2e-5)
    assert not c.passed and c.max_error == pytest.approx(1e-2, rel=1e-3)
    assert "optimizer.state.small.exp_avg" in c.failures[0]


def test_first_moments_fail_on_nan_and_missing_tensors(tmp_path):
    m = torch.ones(4)
    base = _moments_checkpoint(tmp_path / "base", {"a": m, "b": m})
    nan = _moments_checkpoint(
        tmp_path / "nan", {"a": torch.tensor([1.0, math.nan, 1.0, 1.0]), "b": m}
    )
    assert not compare_first_moments(base, nan, tol=1.0).passed
    fewer = _moments_checkpoint(tmp_path / "fewer", {"a": m})
    c = compare_first_moments(base, fewer, tol=1.0)
    assert not c.passed and "only in baseline" in c.failures[0]
