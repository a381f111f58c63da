"""TOML config files for ``python -m torchtitan_ext.train`` (no training)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

from torchtitan_ext.config_file import ConfigFileError, merge_args

MODULE, CONFIG = "muse_glimmer", "muse_glimmer_debugmodel_mm"
JOB = f'[job]\nmodule = "{MODULE}"\nconfig = "{CONFIG}"\n'
REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(tmp_path: Path, text: str, *cli: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigFileError) as info:
        merge_args(["--job.config_file", path, *cli])
    message = str(info.value)
    assert path in message and "\n" not in message
    return message


def _run_entry_point(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )


def test_file_maps_to_overrides_and_config(tmp_path):
    path = _write(
        tmp_path,
        'dump_folder = "outputs/cp"\n'
        + JOB
        + """
[parallelism]
context_parallel_degree = 2
[training]
max_norm = 0.5
enable_cpu_offload = true
disable_cuda_graphs = false
[compile]
components = ["model"]
[lr_scheduler]
decay_type = "cosine"
[optimizer.param_groups.0.optimizer_kwargs]
lr = 0.001
betas = [0.8, 0.9]
[loss.loss_fn]
global_vocab_size = 4096
""",
    )
    args = merge_args(["--job.config_file", path])
    assert args == [
        "--module", MODULE, "--config", CONFIG,
        "--dump_folder", "outputs/cp",
        "--parallelism.context_parallel_degree", "2",
        "--training.max_norm", "0.5",
        "--training.enable_cpu_offload",
        "--training.no-disable_cuda_graphs",
        "--compile.components", "model",
        "--lr_scheduler.decay_type", "cosine",
        "--optimizer.param_groups.0.optimizer_kwargs.lr", "0.001",
        "--optimizer.param_groups.0.optimizer_kwargs.betas", "0.8", "0.9",
        "--loss.loss_fn.global_vocab_size", "4096",
    ]  # fmt: skip

    config = ConfigManager().parse_args(args)
    assert config.dump_folder == "outputs/cp"
    assert config.parallelism.context_parallel_degree == 2
    assert config.training.max_norm == 0.5
    assert config.training.enable_cpu_offload is True
    assert config.training.disable_cuda_graphs is False
    assert config.compile.components == ["model"]
    assert config.lr_scheduler.decay_type == "cosine"
    kwargs = config.optimizer.param_groups[0].optimizer_kwargs
    assert kwargs["lr"] == 0.001 and tuple(kwargs["betas"]) == (0.8, 0.9)
    assert config.loss.loss_fn.global_vocab_size == 4096


def test_equals_form_and_no_file(tmp_path):
    path = _write(tmp_path, JOB + "[training]\nsteps = 3\n")
    assert merge_args([f"--job.config_file={path}"]) == merge_args(
        ["--job.config_file", path]
    )
    cli = ["--module", MODULE, "--config", CONFIG, "--training.steps", "3"]
    assert merge_args(cli) == cli


def test_command_line_wins(tmp_path):
    path = _write(tmp_path, JOB + "[training]\nsteps = 3\nseq_len = 256\n")
    args = merge_args(
        ["--job.config_file", path, "--training.steps", "7"]
        + ["--config", "muse_glimmer_debugmodel"]
    )
    config = ConfigManager().parse_args(args)
    assert config.training.steps == 7
    assert config.training.seq_len == 256
    assert config.model_spec.flavor == "debugmodel"  # --config beat [job] config


def test_job_module_from_command_line(tmp_path):
    path = _write(tmp_path, f'[job]\nconfig = "{CONFIG}"\n')
    args = merge_args(["--job.config_file", path, "--module", MODULE])
    assert ConfigManager().parse_args(args).model_spec.flavor == "debugmodel_mm"


def test_activation_checkpoint_subcommand(tmp_path):
    path = _write(tmp_path, JOB + "[activation_checkpoint]\ndebug = true\n")
    args = merge_args(["--job.config_file", path, "--training.steps", "4"])
    assert args[-2:] == [
        "activation_checkpoint:selective",
        "--activation_checkpoint.debug",
    ]
    config = ConfigManager().parse_args(args)
    assert config.activation_checkpoint.debug and config.training.steps == 4

    # The command line's own choice of policy wins.
    args = merge_args(["--job.config_file", path, "activation-checkpoint:full"])
    config = ConfigManager().parse_args(args)
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"


def test_unknown_key(tmp_path):
    message = _error(tmp_path, JOB + "[parallelism]\ncontext_paralel_degree = 2\n")
    assert "unknown key 'parallelism.context_paralel_degree'" in message
    assert "did you mean 'context_parallel_degree'" in message
    assert "valid keys in [parallelism]:" in message


def test_unknown_section(tmp_path):
    message = _error(tmp_path, JOB + "[paralelism]\ncontext_parallel_degree = 2\n")
    assert "unknown section [paralelism]" in message
    assert "did you mean 'parallelism'" in message


def test_suppressed_key_is_unknown(tmp_path):
    message = _error(tmp_path, JOB + '[model_spec]\nflavor = "x"\n')
    assert "unknown section [model_spec]" in message


@pytest.mark.parametrize(
    "body, expected",
    [
        ('[training]\nsteps = "two"', "training.steps: expected int, got str 'two'"),
        ("[debug]\ndeterministic = 1", "debug.deterministic: expected bool, got int 1"),
        ("[debug]\nseed = 1.5", "debug.seed: expected int, got float 1.5"),
        (
            '[dataloader]\npatch_order = "zigzag"',
            "dataloader.patch_order: expected one of 'block', 'raster', got str",
        ),
        (
            '[compile]\ncomponents = "model"',
            "compile.components: expected list[str], got str 'model'",
        ),
        ("parallelism = 2", "parallelism: expected a table [parallelism], got int 2"),
    ],
)
def test_wrong_type(tmp_path, body, expected):
    assert expected in _error(tmp_path, body + "\n" + JOB)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigFileError, match="nope.toml: config file not found"):
        merge_args(["--job.config_file", path])


def test_toml_syntax_error(tmp_path):
    message = _error(tmp_path, JOB + "[training\nsteps = 3\n")
    assert "invalid TOML" in message and "line 4" in message


@pytest.mark.parametrize("missing", ["module", "config"])
def test_missing_job_entry(tmp_path, missing):
    job = {"module": MODULE, "config": CONFIG}
    del job[missing]
    text = "".join(f'{k} = "{v}"\n' for k, v in job.items())
    message = _error(tmp_path, "[job]\n" + text)
    assert f"[job] has no '{missing}'" in message


def test_entry_point_reports_one_line(tmp_path):
    path = _write(tmp_path, JOB + '[training]\nsteps = "two"\n', name="bad.toml")
    result = _run_entry_point(tmp_path, "--job.config_file", path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("torchtitan_ext.train: error: ")
    assert path in lines[0] and "training.steps" in lines[0]
    assert "Traceback" not in result.stderr


def test_entry_point_hands_args_to_torchtitan(tmp_path):
    # comm.mode=local_tensor makes torchtitan.train.main() return after parsing.
    dump = tmp_path / "dump"
    path = _write(
        tmp_path, f'dump_folder = "{dump}"\n{JOB}[comm]\nmode = "local_tensor"\n'
    )
    result = _run_entry_point(tmp_path, "--job.config_file", path)
    assert result.returncode == 0, result.stderr
    assert "Local tensor mode enabled" in result.stdout + result.stderr
    assert (dump / "structured_logs").is_dir()
