"""Do two training setups train alike? ``python -m torchtitan_ext.tools.parity``.

Runs a baseline and test configurations the way torchtitan's
``scripts/loss_compare.py`` does, then compares their per-step loss and
gradient norm. Typical use: the same job on 1 rank and with context
parallelism on 2 ranks must train identically.

How a comparison is made:

1. A seed checkpoint is created once, on one rank, from the baseline's job
   (``--checkpoint.create_seed_checkpoint``), in ``<output-dir>/seed``. Every
   run then starts from exactly the same weights: each gets its own, empty,
   dump folder and ``--checkpoint.initial_load_path=<seed>/checkpoint/step-0``
   (torchtitan loads the initial path only while the run's own checkpoint
   folder holds no step, and ``--checkpoint.load_only`` keeps it that way).
2. Each run trains ``--steps`` steps with ``--debug.deterministic
   --debug.seed=42`` and logs every step to TensorBoard, in
   ``<output-dir>/<name>/tb_<name>/<timestamp>``.
3. The scalars ``loss_metrics/global_avg_loss`` and ``grad_norm`` (the tags
   torchtitan's ``MetricsProcessor.log`` writes) are read back and compared
   step by step, exactly or within tolerances; a NaN or inf fails.

Modules: ``scalars`` (TensorBoard), ``compare`` (the verdict), ``launch``
(one ``run_train.sh`` command), ``report`` (JSON, plot), ``suite`` (the
engine: one seed and baseline, many tests; a single comparison is a suite of
one), ``__main__`` (the CLI). Nothing here imports torchtitan: training
happens in subprocesses started through ``run_train.sh``; torch only reads
the checkpoints whose first moments are compared.
"""

from .compare import (
    DEFAULT_GRAD_NORM_TOL,
    DEFAULT_LOSS_TOL,
    Comparison,
    StepRow,
    compare,
    format_table,
    per_step_tolerances,
)
from .launch import RUN_TRAIN, RunRecord, RunSpec, launch_run
from .moments import MomentComparison, compare_first_moments
from .scalars import GRAD_NORM_TAG, LOSS_TAG, ParityError, RunScalars, read_tb_scalars
from .suite import ParityCase, ParityResult, run_parity, run_parity_suite

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
    "compare",
    "compare_first_moments",
    "format_table",
    "launch_run",
    "per_step_tolerances",
    "read_tb_scalars",
    "run_parity",
    "run_parity_suite",
]
