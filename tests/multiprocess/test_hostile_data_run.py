"""A real CP2 run on the hostile data: both ranks skip the same samples by name."""

import re

from torchtitan_ext.tools.embedded_data import HOSTILE_SEQ_LEN, ensure_embedded_assets

from ..training_runs import run_train
from ..unit.test_hostile_data import SKIP, SKIP_REASONS


def test_cp2_run_on_hostile_data(tmp_path):
    """Two CP ranks skip the same samples by name and train two steps."""
    assets = ensure_embedded_assets(variant="hostile")
    run_train(
        tmp_path,
        "hostile_cp2",
        2,
        "cp2.toml",
        [
            "--dataloader.dataset=obelics",
            f"--dataloader.dataset_path={assets.dataset_dir}",
            "--dataloader.packing_buffer_size=0",
            f"--training.seq_len={HOSTILE_SEQ_LEN}",
            "--training.local_batch_size=2",
            "--training.steps=2",
        ],
        timeout_s=300,
        env={"LOG_RANK": "0,1"},
    )
    log = (tmp_path / "hostile_cp2.log").read_text().splitlines()
    kinds = ("corrupt_jpeg", "sliver_image", "cut_by_seq_len")
    for rank in (0, 1):
        lines = [line for line in log if line.startswith(f"[rank{rank}]:")]
        skips = [m.groups() for line in lines if (m := SKIP.search(line))]
        assert [(name, int(count)) for name, _, count in skips] == [
            (f"#{position} of dp rank 0's share", position) for position in (1, 2, 3)
        ], rank
        for (_, reason, _), kind in zip(skips, kinds, strict=True):
            assert SKIP_REASONS[kind] in reason, (rank, kind)
        assert any(re.search(r"step:\s+2\b", line) for line in lines), rank
