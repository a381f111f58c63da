"""torchtitan's own training with PR #4244 applied: the upstream side of bitwise tests.

``TRAIN_FILE=tests.upstream_with_4244 MODULE=muse_glimmer ./run_train.sh``
trains torchtitan 0.3.0's muse_glimmer with its vision position resampler
replaced by the fix the plug-in backports (``vision_pos_embed``), in every
rank's process (no file is edited). Without it the plug-in and upstream differ
on every non-square image, which the embedded data has.
"""

from torchtitan_ext import cpu_backend

__all__ = ["apply_4244", "main"]


def apply_4244() -> None:
    from torchtitan.models.muse_glimmer import vision_encoder

    from torchtitan_ext.muse_glimmer import vision_pos_embed

    vision_encoder._vision_pos_embed = vision_pos_embed


def main() -> None:
    cpu_backend.apply()
    apply_4244()
    from torchtitan_ext import train

    train.main()


if __name__ == "__main__":
    main()
