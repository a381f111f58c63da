"""A real CP2 run on the hostile data: both ranks skip the same samples by name.

Its validation reads the hostile webdataset (a caption that is not UTF-8, a
JSON member that does not parse, a tar cut short), which the training data's
OBELICS layout cannot hold: the Validator's loader is the plug-in's too.
"""

import re
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_ext.embedded_data import HOSTILE_SEQ_LEN, ensure_embedded_assets
from torchtitan_ext.muse_glimmer.trainer import SKIPPED_SAMPLES_TAG

from ..training_runs import run_train
from ..unit.test_hostile_data import SKIP, SKIP_REASONS, hostile_webdataset


def _tb_scalar(dump: Path, tag: str) -> dict[int, float]:
    """``tag``'s value per step in the run's one TensorBoard folder."""
    (run,) = (dump / "tb").iterdir()
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_cp2_run_on_hostile_data(tmp_path):
    """Two CP ranks skip the same samples by name, count them, train two steps;
    after step 1 both validate on the hostile webdataset, skipping alike."""
    assets = ensure_embedded_assets(variant="hostile")
    webdataset, webdataset_skips = hostile_webdataset(tmp_path / "webdataset")
    dump = run_train(
        tmp_path,
        "hostile_cp2",
        "cp2.toml",
        [
            "--dataloader.dataset=obelics",
            f"--dataloader.dataset_path={assets.dataset_dir}",
            "--dataloader.packing_buffer_size=0",
            f"--training.seq_len={HOSTILE_SEQ_LEN}",
            "--training.local_batch_size=2",
            "--training.steps=2",
            "--metrics.enable_tensorboard",
            "--metrics.log_freq=1",
            "--validator.enable",
            "--validator.freq=3",  # upstream validates at step 1, then each 3rd
            "--validator.dataloader.dataset=cc12m-test",
            f"--validator.dataloader.dataset_path={webdataset}",
        ],
        timeout_s=300,
        env={"LOG_RANK": "0,1"},
    )
    log = (tmp_path / "hostile_cp2.log").read_text().splitlines()
    kinds = ("corrupt_jpeg", "sliver_image", "cut_by_seq_len")
    for rank in (0, 1):
        lines = [line for line in log if line.startswith(f"[rank{rank}]:")]
        skips = [
            m.groups()
            for line in lines
            if (m := SKIP.search(line)) and m[1].startswith("#")  # OBELICS: no key
        ]
        assert [(name, int(count)) for name, _, count in skips] == [
            (f"#{position} of dp rank 0's share", position) for position in (1, 2, 3)
        ], rank
        for (_, reason, _), kind in zip(skips, kinds, strict=True):
            assert SKIP_REASONS[kind] in reason, (rank, kind)
        assert any(re.search(r"step:\s+2\b", line) for line in lines), rank
        validation_skips = [
            line[line.index("Skipping ") :]
            for line in lines
            if "Skipping " in line and str(webdataset) in line
        ]
        assert validation_skips == webdataset_skips, rank
        counted = [
            int(m[1])
            for line in lines
            if (m := re.search(r"skipped samples: (\d+) on dp rank 0", line))
        ]
        assert counted and counted[-1] == len(skips), (rank, counted)
    # Rank 0 writes TensorBoard; by step 2 it has skipped all three.
    assert _tb_scalar(dump, SKIPPED_SAMPLES_TAG)[2] == len(skips)
