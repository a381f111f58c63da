"""Do two training setups train alike? ``python -m torchtitan_ext.tools.parity``.

As torchtitan's ``scripts/loss_compare.py``: a seed checkpoint is made once, on
one rank, from the baseline's job; every run loads it through
``--checkpoint.initial_load_path`` (read only while the run's own checkpoint
folder holds no step; ``--checkpoint.load_only`` keeps it so), trains with
``--debug.deterministic --debug.seed=42`` and logs each step to TensorBoard,
whose loss and grad_norm are compared step by step (``compare``). Training runs
in subprocesses (``launch``); torch only reads checkpoints (``moments``).
"""

from .compare import (
    DEFAULT_GRAD_NORM_TOL,
    DEFAULT_LOSS_TOL,
    GRAD_NORM_TAG,
    LOSS_TAG,
    Comparison,
    ParityError,
    RunScalars,
    StepRow,
    compare,
    format_table,
    per_step_tolerances,
    read_tb_scalars,
)
from .launch import RUN_TRAIN, RunRecord, RunSpec, launch_run
from .moments import MomentComparison, compare_first_moments
from .suite import ParityCase, ParityResult, SuiteOptions, run_parity, run_parity_suite

__all__ = [
    "DEFAULT_GRAD_NORM_TOL",
    "DEFAULT_LOSS_TOL",
    "GRAD_NORM_TAG",
    "LOSS_TAG",
    "RUN_TRAIN",
    "Comparison",
    "MomentComparison",
    "ParityCase",
    "ParityError",
    "ParityResult",
    "RunRecord",
    "RunScalars",
    "RunSpec",
    "StepRow",
    "SuiteOptions",
    "compare",
    "compare_first_moments",
    "format_table",
    "launch_run",
    "per_step_tolerances",
    "read_tb_scalars",
    "run_parity",
    "run_parity_suite",
]
