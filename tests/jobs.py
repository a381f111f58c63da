"""The shipped jobs, as ``python -m torchtitan_ext.train`` parses them.

One TOML file per job in ``train_configs/``; the production jobs are
torchtitan's 30B_mm flavor under CP on GPU clusters (``30b_mm_*.toml``).
"""

from pathlib import Path

from torchtitan_ext import config_file

TRAIN_CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"

PRODUCTION_CONFIGS = tuple(sorted(p.name for p in TRAIN_CONFIGS.glob("30b_mm_*.toml")))


def train_config(name: str, *overrides: str):
    """The job of ``train_configs/<name>``, with command-line ``overrides``."""
    return config_file.load_job(
        ["--job.config_file", str(TRAIN_CONFIGS / name), *overrides]
    )


def toml_ranks(name: str, *overrides: str) -> int:
    """The ranks ``train_configs/<name>`` with ``overrides`` runs on."""
    return config_file.job_ranks(train_config(name, *overrides))
