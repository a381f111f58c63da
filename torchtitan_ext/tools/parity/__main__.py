"""The command line of the parity harness: one baseline, one test (README: "How
parity is checked" has an example)."""

import argparse
import sys
from collections.abc import Sequence

from .compare import DEFAULT_GRAD_NORM_TOL, DEFAULT_LOSS_TOL
from .launch import DEFAULT_CONFIG, DEFAULT_MODULE, RunSpec
from .suite import run_parity

__all__ = ["build_parser", "main", "specs_from_args"]

_SIDES = {
    "baseline": "a registry job (module and config) or a TOML job file; ranks "
    "default to the product of the file's and options' degrees, 1 for a registry job",
    "test": "an unset module, config or config file is the baseline's",
}
_EPILOG = """\
Write option strings as --test-options="--a 1 --b 2": argparse takes a separate
value that starts with -- for a flag of its own. --seed-options must agree with
the runs on anything that shapes the model."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.parity",
        description="Train a baseline and a test configuration from one seed "
        "checkpoint and compare their per-step loss and grad_norm.",
        epilog=_EPILOG,
    )
    for side, side_help in _SIDES.items():
        add = parser.add_argument_group(side, side_help).add_argument
        add(f"--{side}-module", help="registry module (default: %(default)s)")
        add(f"--{side}-config", help="registry config function (default: %(default)s)")
        add(f"--{side}-config-file", help="TOML job file, instead of module/config")
        add(f"--{side}-options", default="", help="extra trainer flags, one string")
        add(f"--{side}-ngpu", type=int, help="ranks")
    add = parser.add_argument
    add("--steps", type=int, default=10, help="steps (default: 10)")
    add("--seed-options", default="", help="extra flags for the 1-rank seed run")
    add("--no-seed-checkpoint", action="store_true", help="each run inits its weights")
    add("--output-dir", help="new or empty folder (default: outputs/parity/<time>)")
    add("--keep-mixed-precision", action="store_true", help="keep the job's dtype")
    add("--timeout", type=float, help="seconds per run (default: none)")
    add("--quiet", action="store_true", help="do not echo the runs' output")
    add("--forked", action="store_true", help="fork the ranks, not torchrun (CPU)")
    add("--loss-tol", type=float, help="max |dloss| (default: %(default)s)")
    add("--grad-norm-tol", type=float, help="max |dgrad_norm| (default: %(default)s)")
    add("--exact", action="store_true", help="fail on any difference at all")
    add("--moment-step", type=int, help="compare AdamW first moments after this step")
    add("--moment-tol", type=float, help="max relative error (default: report only)")
    parser.set_defaults(baseline_module=DEFAULT_MODULE, baseline_config=DEFAULT_CONFIG)
    parser.set_defaults(loss_tol=DEFAULT_LOSS_TOL, grad_norm_tol=DEFAULT_GRAD_NORM_TOL)
    return parser


def specs_from_args(args: argparse.Namespace) -> tuple[RunSpec, RunSpec]:
    """RunSpecs from parsed args; the test side inherits the baseline's job."""
    fields = ("module", "config", "config_file", "options", "ngpu")
    baseline = RunSpec(**{f: getattr(args, f"baseline_{f}") for f in fields})
    test = {f: getattr(args, f"test_{f}") for f in fields}
    if not (test["module"] or test["config"] or test["config_file"]):
        test["config_file"] = baseline.config_file
    test["module"] = test["module"] or baseline.module
    test["config"] = test["config"] or baseline.config
    return baseline, RunSpec(**test)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 on parity, 1 otherwise, 2 on usage errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if not k.startswith(tuple(_SIDES))}
    options["seed_checkpoint"] = not options.pop("no_seed_checkpoint")
    options["echo"] = not options.pop("quiet")
    try:
        result = run_parity(*specs_from_args(args), **options)
    except ValueError as e:
        parser.error(str(e))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
