"""The command line of the parity harness: one baseline, one test.

Example::

    python -m torchtitan_ext.tools.parity \\
        --baseline-config-file train_configs/packed.toml \\
        --test-config-file train_configs/cp2.toml --steps 10

Write option strings as ``--x-options="..."``: argparse takes a separate
value that starts with ``--`` for a flag of its own.
"""

import argparse
import sys
from collections.abc import Sequence

from .compare import DEFAULT_GRAD_NORM_TOL, DEFAULT_LOSS_TOL
from .launch import DEFAULT_CONFIG, DEFAULT_MODULE, RunSpec
from .suite import run_parity

__all__ = ["build_parser", "main", "specs_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.parity",
        description=(
            "Train a baseline and a test configuration from one seed checkpoint "
            "and compare their per-step loss and grad_norm."
        ),
    )
    for side in ("baseline", "test"):
        _add_side(parser.add_argument_group(side), side)
    _add_run_options(parser)
    _add_bounds(parser)
    return parser


def _add_side(group, side: str) -> None:
    """One side's job: registry function or TOML file, options, ranks."""
    inherited = "" if side == "baseline" else ", or the baseline's"
    group.add_argument(
        f"--{side}-module",
        default=DEFAULT_MODULE if side == "baseline" else None,
        help=f"registry module (default: {DEFAULT_MODULE}{inherited})",
    )
    group.add_argument(
        f"--{side}-config",
        default=DEFAULT_CONFIG if side == "baseline" else None,
        help=f"registry config function (default: {DEFAULT_CONFIG}{inherited})",
    )
    group.add_argument(
        f"--{side}-config-file",
        default=None,
        help="TOML job file (CONFIG_FILE), instead of module/config",
    )
    group.add_argument(
        f"--{side}-options",
        default="",
        help=f'extra trainer flags, one string: --{side}-options="--a 1 --b 2"',
    )
    group.add_argument(
        f"--{side}-ngpu",
        type=int,
        default=None,
        help="ranks (default: the product of the config file's and options' "
        "degrees; 1 for a registry job)",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10, help="steps (default: 10)")
    parser.add_argument(
        "--seed-options",
        default="",
        help="extra flags for the seed-checkpoint run (baseline's job, 1 rank); "
        "must agree with the runs on anything that shapes the model",
    )
    parser.add_argument(
        "--no-seed-checkpoint",
        action="store_true",
        help="let each run initialise its own weights instead",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="new or empty folder for logs and reports "
        "(default: outputs/parity/<timestamp>)",
    )
    parser.add_argument(
        "--keep-mixed-precision",
        action="store_true",
        help="do not force --training.mixed_precision_param float32",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default: none)"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not echo the runs' output"
    )


def _add_bounds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loss-tol", type=float, default=DEFAULT_LOSS_TOL, help="max |dloss|"
    )
    parser.add_argument(
        "--grad-norm-tol",
        type=float,
        default=DEFAULT_GRAD_NORM_TOL,
        help="max |dgrad_norm|",
    )
    parser.add_argument(
        "--exact", action="store_true", help="fail on any difference at all"
    )
    parser.add_argument(
        "--moment-step",
        type=int,
        default=None,
        help="save both runs' state after this step and compare every "
        "parameter's AdamW first moment (default: no comparison)",
    )
    parser.add_argument(
        "--moment-tol",
        type=float,
        default=None,
        help="max first-moment difference relative to each tensor's largest "
        "entry (default: report only)",
    )


def specs_from_args(args: argparse.Namespace) -> tuple[RunSpec, RunSpec]:
    """RunSpecs from parsed args; the test side inherits the baseline's job."""
    baseline = RunSpec(
        module=args.baseline_module,
        config=args.baseline_config,
        config_file=args.baseline_config_file,
        options=args.baseline_options,
        ngpu=args.baseline_ngpu,
    )
    job_given = args.test_module or args.test_config or args.test_config_file
    test = RunSpec(
        module=args.test_module or baseline.module,
        config=args.test_config or baseline.config,
        config_file=args.test_config_file
        or (None if job_given else baseline.config_file),
        options=args.test_options,
        ngpu=args.test_ngpu,
    )
    return baseline, test


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 on parity, 1 otherwise, 2 on usage errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        baseline, test = specs_from_args(args)
        result = run_parity(
            baseline,
            test,
            steps=args.steps,
            seed_options=args.seed_options,
            seed_checkpoint=not args.no_seed_checkpoint,
            output_dir=args.output_dir,
            loss_tol=args.loss_tol,
            grad_norm_tol=args.grad_norm_tol,
            exact=args.exact,
            moment_step=args.moment_step,
            moment_tol=args.moment_tol,
            keep_mixed_precision=args.keep_mixed_precision,
            timeout=args.timeout,
            echo=not args.quiet,
        )
    except ValueError as e:
        parser.error(str(e))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
