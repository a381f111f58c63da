"""``python -m torchtitan_ext.train``: ``torchtitan.train`` plus TOML config files.

Takes the same ``--module/--config`` and ``--section.key`` arguments as
``python -m torchtitan.train``, and also ``--job.config_file PATH.toml`` (see
``torchtitan_ext.config_file``). The merged arguments are handed to torchtitan's
own ``main()`` through ``sys.argv``, so training runs exactly as upstream.

Nothing here imports torchtitan at module level: ``cpu_backend.apply()`` must
run before any torchtitan import. A command that does not point the tokenizer
and dataset paths elsewhere gets the generated debug data made on first use.
"""

import sys

__all__ = ["main"]


_DATA_FLAGS = ("--hf_assets_path", "--dataloader.dataset_path")


def _names_its_own_data(args: list[str]) -> bool:
    """Whether the command (TOML included) sets both paths the debug jobs point
    at the generated data, so none need be made."""
    flags = {arg.split("=", 1)[0].replace("-", "_") for arg in args}
    return all(flag.replace("-", "_") in flags for flag in _DATA_FLAGS)


def main() -> None:
    """Expand ``--job.config_file`` and run ``torchtitan.train.main()``."""
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()

    from torchtitan_ext.config_file import ConfigFileError, merge_args

    try:
        args = merge_args(sys.argv[1:])
    except ConfigFileError as e:
        # One line and exit code 2, as argparse reports usage errors.
        print(f"torchtitan_ext.train: error: {e}", file=sys.stderr)
        sys.exit(2)

    if not _names_its_own_data(args):
        from torchtitan_ext.embedded_data import ensure_embedded_assets

        ensure_embedded_assets()  # quick once made; race-safe across ranks

    import torchtitan.train

    sys.argv = [sys.argv[0], *args]
    torchtitan.train.main()


if __name__ == "__main__":
    main()
