"""Do two training setups train alike? ``python -m torchtitan_ext.tools.parity``,
as torchtitan's ``scripts/loss_compare.py`` (README: "How parity is checked").

Runs train in subprocesses (``launch``) from one seed checkpoint (``suite``);
``compare`` reads their TensorBoard scalars and checkpoints.
"""

from .compare import (
    GRAD_NORM_TAG,
    LOSS_TAG,
    ParityError,
    RunScalars,
    StepRow,
    checkpoint_tensors,
    compare,
    compare_first_moments,
    format_table,
    per_step_tolerances,
    read_tb_scalars,
)
from .launch import RUN_TRAIN, RunRecord, RunSpec, launch_run
from .suite import ParityCase, ParityResult, run_parity, run_parity_suite

__all__ = [
    "GRAD_NORM_TAG",
    "LOSS_TAG",
    "RUN_TRAIN",
    "ParityCase",
    "ParityError",
    "ParityResult",
    "RunRecord",
    "RunScalars",
    "RunSpec",
    "StepRow",
    "checkpoint_tensors",
    "compare",
    "compare_first_moments",
    "format_table",
    "launch_run",
    "per_step_tolerances",
    "read_tb_scalars",
    "run_parity",
    "run_parity_suite",
]
