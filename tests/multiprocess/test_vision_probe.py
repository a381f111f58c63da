"""The vision path is learned under CP: caption loss, true vs shuffled images.

Trains the packed multimodal job under CP2 (``cp2.toml``: ptrr balancer on the
global mask) from the session's seed checkpoint (conftest; the probe tool's own
seed for ``--seeds 42`` is bitwise the same), in fp32 with
``--debug.deterministic``, then runs ``torchtitan_ext.tools.vision_probe`` on
its final model-only checkpoint. It must predict caption tokens clearly better
with its own images than with images shuffled across samples, on the training
set and on freshly drawn images.

Measured (150 steps; the runs are deterministic on one machine, not across
CPU types), embedded / held-out images, CP2 on an Intel Xeon: true 0.6724 /
0.6881, shuffled 0.7831 / 0.7731, gap 0.111 / 0.085 (``vision_probe.PROBE_LR``
says why lr 2e-3). The untrained seed scores exactly ln(2048) either way (its
output norm is 0). About 6 minutes on 2 cores: seed 14 s, CP2 ~320 s, probes
9 s. ``python -m torchtitan_ext.tools.vision_probe --out DIR --fp32 --jobs
packed cp2 --seeds 42`` trains and probes 1 rank and CP2 the same way.

fp32 parameters, as the parity suites use; the jobs' default bf16 mixed
precision is measured over seeds by ``vision_probe --out`` (README, "Vision probe").

``TORCHTITAN_EXT_VISION_PROBE_OUT`` keeps the runs, logs and ``probe.json`` in
that folder; ``TORCHTITAN_EXT_VISION_PROBE_STEPS`` changes the step count.
"""

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from torchtitan_ext.muse_glimmer import check_vision_placeholders
from torchtitan_ext.tools.vision_probe import (
    HELDOUT_SEED,
    LEARNED_MARGIN,
    build_probe_job,
    format_result,
    probe_batches,
    probe_training_args,
    run_probe,
    shuffle_images,
)

from ..training_runs import checkpoint_path, run_train

STEPS = int(os.environ.get("TORCHTITAN_EXT_VISION_PROBE_STEPS", "150"))
TIMEOUT_S = 1200  # per training run; about 4 min on 2 idle cores


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    keep = os.environ.get("TORCHTITAN_EXT_VISION_PROBE_OUT")
    path = Path(keep) if keep else tmp_path_factory.mktemp("vision_probe")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def trained(out_dir, seed_checkpoint) -> dict[str, Path]:
    args = probe_training_args(steps=STEPS, seed_checkpoint=seed_checkpoint, fp32=True)
    dump = run_train(out_dir, "cp2", "cp2.toml", args, timeout_s=TIMEOUT_S)
    return {"cp2": checkpoint_path(dump, STEPS)}


def test_shuffle_moves_images_and_keeps_batches_valid():
    job = build_probe_job(seq_len=64)
    batches = probe_batches(job, 4, batch_size=8)
    shuffled, moved, n_images = shuffle_images(batches, seed=0)
    assert n_images == 32 and moved >= 0.9
    assert shuffle_images(batches, seed=0)[1] == moved  # fixed generator
    merge = job.dataloader.spatial_merge_size
    pool: dict[tuple, list[torch.Tensor]] = {}
    pool_shuffled: dict[tuple, list[torch.Tensor]] = {}
    n_changed = 0
    for (inputs, labels), (new, new_labels) in zip(batches, shuffled, strict=True):
        assert new["input"] is inputs["input"] and new_labels is labels
        assert new["grid_thw"] is inputs["grid_thw"]
        check_vision_placeholders(
            new["input"],
            new["grid_thw"],
            image_id=new["special_tokens"]["image_id"],
            spatial_merge_size=merge,
        )
        for i, thw in enumerate(inputs["grid_thw"].tolist()):
            n = math.prod(thw)
            before, after = inputs["pixel_values"][i], new["pixel_values"][i]
            assert torch.equal(after[n:], before[n:])  # padding untouched
            n_changed += not torch.equal(after[:n], before[:n])
            pool.setdefault(tuple(thw), []).append(before[:n])
            pool_shuffled.setdefault(tuple(thw), []).append(after[:n])
    assert n_changed >= 0.9 * n_images
    # A permutation within each grid: the same images, each exactly once.
    for thw, images in pool.items():
        before = sorted(x.numpy().tobytes() for x in images)
        after = sorted(x.numpy().tobytes() for x in pool_shuffled[thw])
        assert before == after, thw


def test_untrained_model_does_not_depend_on_images(seed_checkpoint):
    result = run_probe(seed_checkpoint, batches=2)
    print(format_result(result))
    # Output norm weight 0: zero logits, uniform over the 2048-token vocab.
    assert result.true_loss == pytest.approx(math.log(2048), abs=1e-5)
    assert result.shuffled_loss == result.true_loss
    assert result.moved_fraction == 1.0


def test_vision_path_is_learned_under_cp(trained, out_dir):
    results = {
        (run, dataset): run_probe(checkpoint, heldout_seed=heldout)
        for run, checkpoint in trained.items()
        for dataset, heldout in (("embedded", None), ("heldout", HELDOUT_SEED))
    }
    (out_dir / "probe.json").write_text(
        json.dumps(
            {f"{run}/{dataset}": asdict(r) for (run, dataset), r in results.items()},
            indent=2,
        )
        + "\n"
    )
    table = "\n".join(format_result(r) for r in results.values())
    print(table)
    for (run, dataset), r in results.items():
        assert r.moved_fraction >= 0.9, f"{run}/{dataset}\n{table}"
        assert r.difference > LEARNED_MARGIN, (
            f"{run}/{dataset}: shuffled images cost only {r.difference:+.4f} "
            f"nats per caption token (need > {LEARNED_MARGIN})\n{table}"
        )
