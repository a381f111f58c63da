"""The production jobs: torchtitan's 30B_mm flavor under CP on GPU clusters.

One TOML file per job in ``train_configs/`` (``30b_mm_*.toml``), parsed as
``python -m torchtitan_ext.train`` parses it.
"""

from pathlib import Path

from torchtitan_ext.tools.simulated_cluster import load_job

TRAIN_CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"

PRODUCTION_CONFIGS = tuple(sorted(p.name for p in TRAIN_CONFIGS.glob("30b_mm_*.toml")))


def production_job(name: str, *overrides: str):
    """The job of ``train_configs/<name>``, with command-line ``overrides``."""
    return load_job(["--job.config_file", str(TRAIN_CONFIGS / name), *overrides])
