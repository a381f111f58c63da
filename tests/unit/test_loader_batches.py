"""What the plug-in's loader puts in a batch: rows within the image cap, sample digests.

Through the real loader (``RobustMMDataLoader`` on OBELICS-layout parquet, the
debug model's own loader config) against torchtitan's ``MMDataLoader``.
"""

import io

import pytest
import torch
from PIL import Image
from torchtitan.components.tokenizer import MultiModalTokenizer
from torchtitan.models.muse_glimmer.config_registry import MUSE_GLIMMER_SPECIAL_TOKENS

from torchtitan_ext.embedded_data import render_image, sample_spec
from torchtitan_ext.muse_glimmer.batch_agreement import (
    FIELDS,
    SAMPLE_DIGESTS,
    batch_fingerprint,
)

from .test_hostile_data import _jpeg, _loader, _parquet

CAPTIONS = 6  # short captions of one image each: all of them fit one packed row
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding:DeprecationWarning",
)


@pytest.fixture(scope="module")
def tokenizer(embedded_assets):
    return MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(embedded_assets.tokenizer_dir)
    )


def _captions(tmp_path, jpegs: list[bytes] | None = None):
    jpegs = jpegs or [_jpeg(i) for i in range(CAPTIONS)]
    texts = [[None, sample_spec(i).caption] for i in range(len(jpegs))]
    return _parquet(tmp_path / "p", texts, [[jpeg, None] for jpeg in jpegs])


def _images(batch) -> int:
    grid_thw_N3 = batch[0]["grid_thw"]
    return 0 if grid_thw_N3 is None else grid_thw_N3.shape[0]


def _upstream_empties_a_batch(data, tokenizer, caplog, **options):
    """Upstream's loader fails on ``data`` at an image cap of 2; the plug-in's
    loader and its batches, the warnings it logs in ``caplog``."""
    options = {"max_images_per_batch": 2, **options}
    with pytest.raises(RuntimeError, match="empty list of sequences"):
        list(_loader(data, "obelics", tokenizer, robust=False, **options))
    caplog.clear()
    caplog.set_level("WARNING")
    loader = _loader(data, "obelics", tokenizer, robust=True, **options)
    return loader, list(loader)


def test_a_packed_row_holds_at_most_max_images_per_batch(tmp_path, tokenizer, caplog):
    """Upstream packs by tokens alone: one row of six images, which the collator
    removes whole (cap 2, one row a batch), and the empty batch raises."""
    loader, batches = _upstream_empties_a_batch(
        _captions(tmp_path), tokenizer, caplog, packing_buffer_size=4
    )
    assert [_images(b) for b in batches] == [2, 2, 2]
    assert loader.skipped_samples == 0 and not caplog.records  # nothing lost
    assert sum(b[0][SAMPLE_DIGESTS].numel() for b in batches) == CAPTIONS


def test_a_sample_over_the_cap_alone_is_a_named_counted_skip(
    tmp_path, tokenizer, caplog
):
    """Three images in one document, cap 2: upstream's collator empties the batch."""
    jpegs = [_jpeg(i) for i in range(4)]
    caption = sample_spec(0).caption
    data = _parquet(
        tmp_path / "p",
        [[caption, None, None, None], [None, caption]],
        [[None, *jpegs[:3]], [jpegs[3], None]],
    )
    loader, batches = _upstream_empties_a_batch(
        data, tokenizer, caplog, packing_buffer_size=0
    )
    assert [_images(b) for b in batches] == [1]
    assert loader.skipped_samples == 1
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping sample #0 of dp rank 0's share: its 3 vision entries exceed "
        "dataloader.max_images_per_batch 2. Samples skipped so far on dp rank 0: 1"
    ]


def _fingerprint(batch) -> dict[str, int]:
    return dict(zip(FIELDS, batch_fingerprint(*batch).tolist(), strict=True))


def _reencoded(index: int) -> bytes:
    """Sample ``index``'s image, encoded again: other bytes, the same grid."""
    buf = io.BytesIO()
    render_image(sample_spec(index)).save(buf, format="JPEG", quality=70)
    return buf.getvalue()


def test_the_batch_fingerprint_reads_sample_digests_not_pixels(tmp_path, tokenizer):
    """The training thread's check costs no pixel bytes; a sample read from other
    bytes is still seen, and what it cannot see is what its docstring says."""
    options = {"max_images_per_batch": 2, "packing_buffer_size": 4}
    (tmp_path / "a").mkdir()
    batch, *_ = _loader(
        _captions(tmp_path / "a"), "obelics", tokenizer, robust=True, **options
    )
    assert batch[0][SAMPLE_DIGESTS].shape == (2,)  # the row's two samples
    base = _fingerprint(batch)
    # Pixels decoded differently from the same bytes (an unseeded augmentation,
    # another libjpeg on one node): the same fingerprint. The blind spot.
    batch[0]["pixel_values"] = torch.zeros_like(batch[0]["pixel_values"])
    assert _fingerprint(batch) == base
    # One sample fetched as other bytes (a re-encoded copy on one rank): seen.
    (tmp_path / "b").mkdir()
    jpegs = [_reencoded(0), *(_jpeg(i) for i in range(1, CAPTIONS))]
    assert (
        Image.open(io.BytesIO(jpegs[0])).size == Image.open(io.BytesIO(_jpeg(0))).size
    )
    other, *_ = _loader(
        _captions(tmp_path / "b", jpegs), "obelics", tokenizer, robust=True, **options
    )
    assert torch.equal(other[0]["input"], batch[0]["input"])
    assert torch.equal(other[0]["grid_thw"], batch[0]["grid_thw"])
    assert other[0][SAMPLE_DIGESTS][0] != batch[0][SAMPLE_DIGESTS][0]
    assert other[0][SAMPLE_DIGESTS][1] == batch[0][SAMPLE_DIGESTS][1]
    changed = {k for k, v in _fingerprint(other).items() if v != base[k]}
    assert changed == {"content"}


def test_a_row_the_image_bound_blocks_is_emitted_before_the_pass_ends():
    """Documents of 3 images at a cap of 4: no second one ever joins a row, and
    a row short of its tokens would wait for one (the buffer growing) forever."""
    from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker

    from torchtitan_ext.muse_glimmer.data import _ImageCappedPacker

    upstream = MMSamplePacker(max_seq_length=512, buffer_size=2, batch_size=1)
    packer = _ImageCappedPacker(upstream, max_images=4, temporal=2)
    for index in range(6):
        packer.add_sample(
            {
                "input_ids": torch.full((20,), index),
                "labels": torch.zeros(20),
                "positions": torch.arange(20),
                "pixel_values": [torch.zeros(1, 28, 28, 3)] * 3,
            }
        )
    rows = [row["input_ids"].unique().tolist() for row in packer.packed_samples]
    assert rows == [[0], [1], [2], [3], [4]]  # one a row, the last still buffered
    assert len(packer._sample_buffer) == 1


def test_a_row_with_a_restored_sample_carries_no_digests():
    """A sample buffered by an older loader's checkpoint has no digest: its row
    carries none, so the batch check hashes that batch's pixels instead."""
    from torchtitan_ext.muse_glimmer.data import _ImageCappedPacker

    def sample(digests):
        return {
            "input_ids": torch.zeros(4),
            "labels": torch.zeros(4),
            "positions": torch.arange(4),
            **digests,
        }

    new, restored = sample({SAMPLE_DIGESTS: [7]}), sample({})
    assert _ImageCappedPacker._merge_samples([new, new])[SAMPLE_DIGESTS] == [7, 7]
    assert SAMPLE_DIGESTS not in _ImageCappedPacker._merge_samples([new, restored])
