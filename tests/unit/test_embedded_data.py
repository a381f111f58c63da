"""The embedded dataset/tokenizer must load through torchtitan's own multimodal
pipeline, be byte-for-byte reproducible, and carry captions that only the
image can explain."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from torchtitan_ext.embedded_data import (
    ASSETS_ENV_VAR,
    BACKGROUNDS,
    COLOURS,
    GENERATOR_VERSION,
    SHAPES,
    EmbeddedAssets,
    SampleSpec,
    ShapeSpec,
    default_root,
    ensure_embedded_assets,
    render_image,
    sample_spec,
)

MERGE = 2

# torchtitan decodes with torchvision.io, which warns once per image.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding:DeprecationWarning",
    "ignore:'set_vital' is deprecated:UserWarning",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedAssets:
    return ensure_embedded_assets(tmp_path_factory.mktemp("assets") / "embedded")


@pytest.fixture(scope="module")
def tokenizer(assets: EmbeddedAssets):
    from torchtitan.components.tokenizer import MultiModalTokenizer
    from torchtitan.models.muse_glimmer.config_registry import (
        MUSE_GLIMMER_SPECIAL_TOKENS,
    )

    return MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(assets.tokenizer_dir)
    )


def _mm_dataloader(assets: EmbeddedAssets, tokenizer, **overrides):
    """muse_glimmer's own multimodal loader config, pointed at our shards."""
    from torchtitan.models.muse_glimmer import model_registry
    from torchtitan.models.muse_glimmer.config_registry import (
        _muse_glimmer_mm_dataloader,
    )

    spec = model_registry("debugmodel_mm", attn_backend="flex")
    config = _muse_glimmer_mm_dataloader(spec, assets.dataset)
    config = replace(
        config, dataset_path=str(assets.dataset_dir), infinite=False, **overrides
    )
    return config.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=256,
        local_batch_size=2,
    )


def _samples(dataset_dir: Path) -> list[tuple[int, bytes | None, str]]:
    """(index, jpg bytes or None, caption) for every record, in shard order."""
    records: dict[int, dict[str, bytes]] = {}
    for shard in sorted(dataset_dir.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".")
                records.setdefault(int(key), {})[ext] = tar.extractfile(member).read()
    return [(i, r.get("jpg"), r["txt"].decode()) for i, r in sorted(records.items())]


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_generation_is_byte_deterministic(tmp_path: Path) -> None:
    a = ensure_embedded_assets(tmp_path / "a")
    b = ensure_embedded_assets(tmp_path / "b")
    hashes = _hashes(a.root)
    assert hashes == _hashes(b.root)
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(
        hashes
    )
    assert len([f for f in hashes if f.startswith("cc12m/")]) == 4


def test_ensure_is_idempotent_and_race_safe(tmp_path: Path) -> None:
    root = tmp_path / "embedded"
    results: list[EmbeddedAssets] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_embedded_assets(root)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    mtime = (root / "manifest.json").stat().st_mtime_ns
    assert ensure_embedded_assets(root) == results[0]  # fast path, no rebuild
    assert (root / "manifest.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded"]  # no temps
    assert results[0].tokenizer_dir == root / "tokenizer"
    assert results[0].dataset_dir == root / "cc12m"


def test_foreign_and_stale_directories(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    (foreign / "x").mkdir(parents=True)
    with pytest.raises(FileExistsError):
        ensure_embedded_assets(foreign)
    assert (foreign / "x").is_dir()

    stale = ensure_embedded_assets(tmp_path / "stale").root
    manifest = stale / "manifest.json"
    manifest.write_text(
        manifest.read_text().replace(
            f'"generator_version": {GENERATOR_VERSION}', '"generator_version": 0'
        )
    )
    ensure_embedded_assets(stale)
    assert f'"generator_version": {GENERATOR_VERSION}' in manifest.read_text()


def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ASSETS_ENV_VAR, raising=False)
    repo = Path(__file__).resolve().parents[2]
    assert default_root() == repo / "assets" / "embedded"
    monkeypatch.setenv(ASSETS_ENV_VAR, str(tmp_path / "mine"))
    assert default_root() == tmp_path / "mine"
    assert default_root("some_without_image") == tmp_path / "mine-some_without_image"


def test_total_size_is_small(assets: EmbeddedAssets) -> None:
    total = sum(p.stat().st_size for p in assets.root.rglob("*") if p.is_file())
    assert total < 5 * 2**20


def test_tokenizer_knows_every_caption(assets: EmbeddedAssets, tokenizer) -> None:
    assert tokenizer.get_vocab_size() < 2048
    assert (tokenizer.bos_token, tokenizer.eos_token) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
    )
    unk = tokenizer.token_to_id("<unk>")
    for _, _, caption in _samples(assets.dataset_dir):
        ids = tokenizer.encode(caption)
        assert ids[0] == tokenizer.bos_id and unk not in ids
        assert tokenizer.decode(ids) == caption
    assert unk not in tokenizer.encode("no image")


def _recover_caption(jpg: bytes, index: int) -> str:
    """Read the caption off the pixels by template matching, knowing only the
    image size: proves the caption is a function of the image content."""
    img = np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB"), dtype=np.float32)
    h, w, _ = img.shape
    corner = img[0, 0]
    bg = min(BACKGROUNDS, key=lambda b: np.abs(corner - BACKGROUNDS[b]).sum())
    base = SampleSpec(index, h, w, bg, objects=())
    candidates = [None] + [(c, s) for c in COLOURS for s in SHAPES]
    objects = []
    for q in range(4):
        ys = slice((q // 2) * h // 2, (q // 2 + 1) * h // 2)
        xs = slice((q % 2) * w // 2, (q % 2 + 1) * w // 2)

        def error(cand, q=q, ys=ys, xs=xs) -> float:
            objs = () if cand is None else (ShapeSpec(*cand, q),)
            ref = np.asarray(render_image(replace(base, objects=objs)), np.float32)
            return float(np.abs(ref[ys, xs] - img[ys, xs]).mean())

        best = min(candidates, key=error)
        if best is not None:
            objects.append(ShapeSpec(*best, q))
    return replace(base, objects=tuple(objects)).caption


def test_captions_are_determined_by_images(assets: EmbeddedAssets) -> None:
    samples = _samples(assets.dataset_dir)
    assert [i for i, _, _ in samples] == list(range(512))
    for index, jpg, caption in samples:
        assert jpg is not None and caption == sample_spec(index).caption
    for index, jpg, caption in samples[:96]:
        assert _recover_caption(jpg, index) == caption
    assert len({c for _, _, c in samples}) > 300


def test_vision_token_counts_vary(assets: EmbeddedAssets) -> None:
    from torchtitan.hf_datasets.multimodal.utils.image import (
        calculate_vision_tokens,
        process_image,
    )

    counts = Counter()
    for index, jpg, _ in _samples(assets.dataset_dir):
        pixels = process_image(
            jpg, patch_size=14, merge_size=MERGE, min_pixels=784, max_pixels=3136
        )
        n, _, _ = calculate_vision_tokens(
            1, pixels.shape[1], pixels.shape[2], 14, MERGE, 1
        )
        spec = sample_spec(index)
        assert pixels.shape[1:3] == (spec.height, spec.width)  # no resampling
        counts[n] += 1
    assert sorted(counts) == [1, 2, 3, 4]
    assert min(counts.values()) > 50


# With packing, a 256-token row holds ~10 captioned images, so muse_glimmer's
# max_images_per_batch=8 would make the collator drop every row of a batch.
@pytest.mark.parametrize(
    "overrides",
    [{}, {"packing_buffer_size": 64, "max_images_per_batch": 64}],
    ids=["unpacked", "packed"],
)
def test_mm_dataloader_batches(assets: EmbeddedAssets, tokenizer, overrides) -> None:
    from torchtitan.components.loss import IGNORE_INDEX

    loader = _mm_dataloader(assets, tokenizer, **overrides)
    per_image, num_images, num_batches = Counter(), 0, 0
    for inputs, labels in loader:
        num_batches += 1
        tokens, grid = inputs["input"], inputs["grid_thw"]
        assert tokens.shape == labels.shape == (2, 256)
        assert inputs["pixel_values"] is not None and grid is not None
        assert inputs["pixel_values"].shape[0] == grid.shape[0]
        merged = grid[:, 0] * grid[:, 1] * grid[:, 2] // MERGE**2
        is_image = tokens == tokenizer.image_id
        assert int(is_image.sum()) == int(merged.sum())
        # Vision placeholders are never prediction targets.
        assert (labels[:, :-1][is_image[:, 1:]] == IGNORE_INDEX).all()
        per_image.update(merged.tolist())
        num_images += grid.shape[0]
    assert num_images == 512
    assert len(per_image) >= 3
    if overrides:
        assert num_batches < 64  # ~10 samples per packed row
    else:
        assert num_batches == 256


def test_some_without_image_variant(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    assets = ensure_embedded_assets(tmp_path / "v", variant="some_without_image")
    assert assets.dataset == "obelics"
    shards = sorted(assets.dataset_dir.glob("*.parquet"))
    assert len(shards) == 4
    rows = [row for shard in shards for row in pq.read_table(shard).to_pylist()]
    assert len(rows) == 512
    text_only = [i for i, row in enumerate(rows) if row["images"] == [None]]
    # Runs of 64, every other one text only, shifted by 32 from shard to shard.
    assert text_only[:3] == [64, 65, 66] and 128 + 32 in text_only
    assert len(text_only) == 256
    for i, row in enumerate(rows):
        if i in text_only:
            assert row["texts"][0].startswith("no image : ")
        else:
            assert row["texts"][0] is None and row["images"][1] is None
            assert row["images"][0][:2] == b"\xff\xd8"  # a JPEG
            assert row["texts"][1] == sample_spec(i).caption


def test_some_without_image_through_mm_dataloader(tmp_path: Path) -> None:
    """torchtitan's own loader reads the variant: packed rows without images."""
    from torchtitan.components.tokenizer import MultiModalTokenizer
    from torchtitan.models.muse_glimmer.config_registry import (
        MUSE_GLIMMER_SPECIAL_TOKENS,
    )

    assets = ensure_embedded_assets(tmp_path / "v", variant="some_without_image")
    tokenizer = MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(assets.tokenizer_dir)
    )
    batches = list(
        _mm_dataloader(
            assets, tokenizer, packing_buffer_size=32, max_images_per_batch=128
        )
    )
    grids = [b["grid_thw"] for b, _ in batches if b["grid_thw"] is not None]
    images = sum(grid.shape[0] for grid in grids)
    assert images == 256
    without_image = [b for b, _ in batches if b["pixel_values"] is None]
    assert without_image and len(without_image) < len(batches)


def test_jobs_name_the_data_without_making_it(tmp_path: Path) -> None:
    """The model package imports nothing from ``tools/``, and calling a job
    function writes nothing: the launcher or the explicit command makes the data."""
    code = (
        "import sys\n"
        "from torchtitan_ext import cpu_backend\n"
        "cpu_backend.apply()\n"
        "from torchtitan_ext.muse_glimmer import config_registry\n"
        "job = config_registry.muse_glimmer_debugmodel_mm_packed()\n"
        "print(job.hf_assets_path, job.dataloader.dataset_path)\n"
        "print(sorted(m for m in sys.modules if 'torchtitan_ext.tools' in m))\n"
    )
    assets = tmp_path / "assets"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, ASSETS_ENV_VAR: str(assets)},
        capture_output=True,
        text=True,
        check=True,
    )
    paths, tools = run.stdout.splitlines()[-2:]
    assert paths == f"{assets / 'tokenizer'} {assets / 'cc12m'}"
    assert tools == "[]"
    assert not assets.exists()
