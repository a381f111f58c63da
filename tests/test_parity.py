"""The parity harness: comparison, TensorBoard reading, launching, one real run."""

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from torchtitan_ext.parity import (
    GRAD_NORM_TAG,
    LOSS_TAG,
    ParityError,
    RunScalars,
    RunSpec,
    build_parser,
    compare,
    format_table,
    main,
    read_tb_scalars,
    run_parity,
)

SMALL = "--training.seq_len 256 --training.local_batch_size 2"


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
    nan_both = compare(_scalars([math.nan]), _scalars([math.nan]), exact=True)
    assert nan_both.passed


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
# ``--fake.offset=X`` adds X to the loss at step 2.
FAKE_TRAIN = f"""\
#!{sys.executable}
import os, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
flags = set(sys.argv[1:])
dump = Path(args["--dump_folder"])
assert os.environ["NGPU"] and (os.environ.get("CONFIG_FILE") or os.environ["MODULE"])
print("fake run", os.environ["NGPU"], sys.argv[1:], flush=True)
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
for step in range(1, int(args["--training.steps"]) + 1):
    values = {{
        "{LOSS_TAG}": 8.0 - step / 8 + (offset if step == 2 else 0),
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
    import torchtitan_ext.parity as parity

    monkeypatch.setattr(parity, "RUN_TRAIN", fake)
    common = ["--steps", "3", "--quiet", "--test-ngpu", "2"]
    assert main([*common, "--output-dir", str(tmp_path / "a"), "--exact"]) == 0
    summary = json.loads((tmp_path / "a" / "parity.json").read_text())
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
    summary = json.loads((tmp_path / "c" / "parity.json").read_text())
    assert not summary["passed"] and "loss_tol" in summary["failures"][0]
    assert summary["max_dloss"] == pytest.approx(1e-3, rel=1e-3)
    assert (tmp_path / "c" / "parity.png").stat().st_size > 0
    # An output dir that holds files is refused: stale runs would be compared.
    with pytest.raises(SystemExit) as info:
        main([*common, "--output-dir", out_c])
    assert info.value.code == 2


def test_cli_specs():
    args = build_parser().parse_args(
        ["--baseline-config", "cfg_a", "--baseline-options", "--x 1"]
    )
    from torchtitan_ext.parity import _specs

    baseline, test = _specs(args)
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
# One real run: two identical single-rank jobs must match bit for bit
# ---------------------------------------------------------------------------


def test_real_identical_runs_are_exact(tmp_path):
    start = time.monotonic()
    result = run_parity(
        RunSpec(options=SMALL),
        RunSpec(options=SMALL),
        steps=3,
        seed_options=SMALL,
        exact=True,
        output_dir=tmp_path / "parity",
        timeout=600,
    )
    took = time.monotonic() - start
    assert result.passed, "\n".join(result.failures + [r.log_path for r in result.runs])
    assert [r.step for r in result.rows] == [1, 2, 3]
    assert result.max_dloss == 0.0 and result.max_dgrad_norm == 0.0
    assert all(math.isfinite(r.baseline_loss) for r in result.rows)
    assert result.png_path is not None and result.png_path.stat().st_size > 0
    summary = json.loads(result.json_path.read_text())
    assert summary["passed"] and summary["exact"]
    seed = tmp_path / "parity" / "seed" / "checkpoint" / "step-0"
    assert (seed / ".metadata").is_file()
    for run in summary["runs"]:
        assert run["returncode"] == 0 and run["wall_s"] > 0
        assert Path(run["log_path"]).is_file()
    for name in ("baseline", "test"):
        log = (tmp_path / "parity" / f"{name}.log").read_text()
        assert f"Loading the checkpoint from {seed}" in log
    print(f"real parity run: {took:.1f} s")
