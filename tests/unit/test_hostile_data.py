"""Hostile data: every bad sample trains as intended or is skipped by name, counted.

The cases are the ``hostile`` embedded variant's (a corrupt JPEG, a sliver past
torchtitan's aspect-ratio limit, image placeholders cut by ``seq_len``, an empty
caption, an oversized and a sub-patch image), plus a corrupt JPEG in the cc12m
tar layout, a record the sample processor raises on, and data without one good
sample; and what HF's webdataset builder met inside its own iterator: a caption
that is not UTF-8, a JSON member that does not parse and a tar cut short. Each
goes through torchtitan's own loader and the plug-in's.
"""

import dataclasses
import gzip
import hashlib
import inspect
import io
import json
import re
import tarfile
import threading
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import load as datasets_load
from datasets import load_dataset
from PIL import Image
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import MultiModalTokenizer
from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
from torchtitan.models.muse_glimmer import model_registry as upstream_model_registry
from torchtitan.models.muse_glimmer.config_registry import (
    MUSE_GLIMMER_SPECIAL_TOKENS,
    _muse_glimmer_mm_dataloader,
)

from torchtitan_ext.embedded_data import (
    HOSTILE_SAMPLES,
    HOSTILE_SEQ_LEN,
    EmbeddedDataConfig,
    ensure_embedded_assets,
    hostile_kind,
    render_image,
    sample_spec,
)
from torchtitan_ext.muse_glimmer import (
    VisionGeometry,
    check_vision_placeholders,
    model_registry,
    post_process_with_vision_bank_indices,
)
from torchtitan_ext.muse_glimmer.data import RobustMMDataLoader
from torchtitan_ext.muse_glimmer.webdataset import (
    UndecodedWebDataset,
    decode_members,
    hf_webdataset,
    members_undecoded,
    report_cut_shards,
)

# torchtitan decodes with torchvision.io, which warns once per image.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding:DeprecationWarning",
    "ignore:'set_vital' is deprecated:UserWarning",
)

SMALL = EmbeddedDataConfig(variant="hostile", num_samples=32, num_shards=4)
PER_SHARD = SMALL.num_samples // SMALL.num_shards
PATCH, MIN_PIXELS, MAX_PIXELS = 14, 784, 3136  # muse_glimmer's debug loader
SKIP = re.compile(
    r"Skipping sample (.+?): (.*)\. Samples skipped so far on dp rank 0: (\d+)"
)
SKIP_REASONS = {
    "corrupt_jpeg": "Image is incomplete or truncated",
    "sliver_image": "Absolute aspect ratio must be smaller than 200, got 300.0",
    "cut_by_seq_len": "260 tokens exceed training.seq_len 256, "
    "2 image placeholder tokens among them",
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return ensure_embedded_assets(
        tmp_path_factory.mktemp("hostile") / "embedded", variant="hostile", config=SMALL
    )


@pytest.fixture(scope="module")
def tokenizer(hostile):
    return MultiModalTokenizer.Config(**MUSE_GLIMMER_SPECIAL_TOKENS).build(
        tokenizer_path=str(hostile.tokenizer_dir)
    )


def _loader(
    dataset_dir,
    dataset,
    tokenizer,
    *,
    robust,
    seq_len=HOSTILE_SEQ_LEN,
    local_batch_size=1,
    dp_world_size=1,
    dp_rank=0,
    **overrides,
):
    """muse_glimmer's own loader config: upstream's loader, or the plug-in's."""
    spec = upstream_model_registry("debugmodel_mm", attn_backend="flex")
    config = _muse_glimmer_mm_dataloader(spec, dataset)
    if robust:
        config = RobustMMDataLoader.Config(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        )
    config = dataclasses.replace(
        config, dataset_path=str(dataset_dir), **{"infinite": False, **overrides}
    )
    return config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
    )


def _skips(caplog) -> list[tuple[str, str, int]]:
    return [
        (m[1], m[2], int(m[3]))
        for r in caplog.records
        if (m := SKIP.fullmatch(r.getMessage()))
    ]


def _first_batch_error(loader, looking_for: str) -> BaseException:
    """What the loader's first batch raises, within 60 s (not a loop for ever)."""
    errors: list[BaseException] = []

    def first_batch():
        try:
            next(iter(loader))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=first_batch, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), f"the loader is still looking for {looking_for}"
    (error,) = errors
    return error


def _jpeg(index: int) -> bytes:
    buf = io.BytesIO()
    render_image(sample_spec(index)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _parquet(path: Path, texts: list, images: list) -> Path:
    path.mkdir()
    table = pa.table(
        {
            "texts": pa.array(texts, pa.list_(pa.string())),
            "images": pa.array(images, pa.list_(pa.binary())),
        }
    )
    pq.write_table(table, path / "data.parquet")
    return path


# Sample 0001's caption in Latin-1 (not UTF-8); sample 0002's json member cut.
BAD_MEMBERS = {"txt": "un é".encode("latin-1"), "json": b'{"key": "0002", "capt'}


def _error(action) -> str:
    """What ``action`` raises, as the plug-in's skip reasons quote an error."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError("expected an error")


def _members(index: int) -> dict[str, bytes]:
    """Embedded sample ``index`` as a cc12m webdataset sample: jpg, txt, json."""
    caption = sample_spec(index).caption
    meta = json.dumps({"key": f"{index:04d}", "caption": caption})
    return {"jpg": _jpeg(index), "txt": caption.encode(), "json": meta.encode()}


def _tar(path: Path, samples: dict[str, dict[str, bytes]], cut_in=None) -> Path:
    """A webdataset shard (key -> members); ``cut_in``: the file ends halfway
    through that sample's jpg, as an interrupted download leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if cut_in is not None:
        with tarfile.open(path) as tar:
            jpg = tar.getmember(f"{cut_in}.jpg")
        with open(path, "r+b") as file:
            file.truncate(jpg.offset_data + jpg.size // 2)
    return path


def _cut_error(shard: Path) -> str:
    """What tarfile says reading ``shard`` as HF streams it."""

    def read() -> None:
        with tarfile.open(shard, "r|") as tar:
            for member in tar:
                tar.extractfile(member).read()

    return _error(read)


def hostile_webdataset(out_dir: Path) -> tuple[Path, list[str]]:
    """cc12m shards holding what a crawl's webdataset delivers, and the plug-in's
    warnings on them, in order: shard 0 holds samples 0000..0003, 0001's caption
    not UTF-8 and 0002's json not JSON; shard 1 is cut inside 0005's jpg, after
    0004; shards 2 and 3 hold 0007, 0008 and 0009. Six samples train. Two
    workers read shards 0, 2 and 1, 3: each has a batch after its skips (a
    batch carries the count home)."""
    samples = {f"{i:04d}": _members(i) for i in range(10)}
    samples["0001"]["txt"], samples["0002"]["json"] = BAD_MEMBERS.values()
    keys = [["0000", "0001", "0002", "0003"], ["0004", "0005", "0006"]]
    keys += [["0007", "0008"], ["0009"]]
    shards = [
        _tar(
            out_dir / f"hostile-{n}.tar",
            {key: samples[key] for key in shard},
            cut_in="0005" if n == 1 else None,
        )
        for n, shard in enumerate(keys)
    ]
    reasons = [
        f"Skipping sample {shards[0]}:0001: its member 'txt' does not decode: "
        + _error(lambda: BAD_MEMBERS["txt"].decode("utf-8")),
        f"Skipping sample {shards[0]}:0002: its member 'json' does not decode: "
        + _error(lambda: json.loads(BAD_MEMBERS["json"])),
        f"Skipping the rest of shard {shards[1]} after sample 0004: it is cut "
        f"short ({_cut_error(shards[1])})",
    ]
    return out_dir, [
        f"{reason}. Samples skipped so far on dp rank 0: {count}"
        for count, reason in enumerate(reasons, 1)
    ]


def _skip_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skip")]


def _same_batches(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        torch.equal(g["input"], w["input"])
        and torch.equal(g["pixel_values"], w["pixel_values"])
        and torch.equal(g_labels, w_labels)
        for (g, g_labels), (w, w_labels) in zip(got, want, strict=True)
    )


def test_hostile_variant_records(hostile):
    rows = [
        row
        for shard in sorted(hostile.dataset_dir.glob("*.parquet"))
        for row in pq.read_table(shard).to_pylist()
    ]
    assert len(rows) == SMALL.num_samples and hostile.dataset == "obelics"
    for index, row in enumerate(rows):
        kind = hostile_kind(index, SMALL)
        assert kind == HOSTILE_SAMPLES.get(index % PER_SHARD)
        text, jpg = (
            (row["texts"][0], row["images"][1])
            if kind == "cut_by_seq_len"
            else (row["texts"][1], row["images"][0])
        )
        if kind == "corrupt_jpeg":
            with pytest.raises(OSError):
                Image.open(io.BytesIO(jpg)).load()
            continue
        size = Image.open(io.BytesIO(jpg)).size
        spec = sample_spec(index, SMALL)
        expected = {
            "sliver_image": (300, 1),
            "oversized_image": (448, 336),
            "tiny_image": (8, 6),
            "cut_by_seq_len": (56, 56),
        }.get(kind, (spec.width, spec.height))
        assert size == expected, (index, kind)
        if kind == "cut_by_seq_len":
            assert len(text.split()) == HOSTILE_SEQ_LEN - 4
        else:
            assert text == ("" if kind == "empty_caption" else spec.caption)


def test_each_hostile_case_through_the_loader(hostile, tokenizer, caplog):
    """Upstream and the plug-in keep the same batches; only the plug-in names skips."""
    caplog.set_level("WARNING")
    upstream = list(_loader(hostile.dataset_dir, "obelics", tokenizer, robust=False))
    upstream_warnings = [r.getMessage() for r in caplog.records]
    caplog.clear()
    batches = list(_loader(hostile.dataset_dir, "obelics", tokenizer, robust=True))

    skipped = {"corrupt_jpeg", "sliver_image", "cut_by_seq_len"}
    kinds = [hostile_kind(i, SMALL) for i in range(SMALL.num_samples)]
    expected_skips = [
        (f"#{i} of dp rank 0's share", SKIP_REASONS[kind])
        for i, kind in enumerate(kinds)
        if kind in skipped
    ]
    skips = _skips(caplog)
    assert [name for name, _, _ in skips] == [name for name, _ in expected_skips]
    for (name, reason, _), (_, why) in zip(skips, expected_skips, strict=True):
        assert why in reason, name
    assert [count for *_, count in skips] == list(range(1, len(expected_skips) + 1))
    # torchtitan skips the same samples, naming none of them; the plug-in's
    # warning carries those reasons instead.
    unnamed = ("Cannot process all images for sample. Dropping", "Sample length")
    assert [m.startswith(unnamed) for m in upstream_warnings].count(True) == len(skips)
    assert not any(r.getMessage().startswith(unnamed) for r in caplog.records)

    kept = [kind for kind in kinds if kind not in skipped]
    assert len(batches) == len(upstream) == len(kept)
    for (inputs, labels), (up_inputs, up_labels), kind in zip(
        batches, upstream, kept, strict=True
    ):
        assert torch.equal(inputs["input"], up_inputs["input"])
        assert torch.equal(labels, up_labels)
        assert torch.equal(inputs["pixel_values"], up_inputs["pixel_values"])
        tokens = inputs["input"][0]
        ((t, h, w),) = inputs["grid_thw"].tolist()
        assert MIN_PIXELS <= h * w * PATCH * PATCH <= MAX_PIXELS, kind
        assert int((tokens == tokenizer.image_id).sum()) == h * w // 4, kind
        trained = labels[0][labels[0] != IGNORE_INDEX]
        if kind == "empty_caption":  # only the end of text after the image
            assert trained.tolist() == [tokenizer.eos_id]
        else:
            assert len(trained) > 1, kind
    grids = {k: b["grid_thw"].tolist() for (b, _), k in zip(batches, kept, strict=True)}
    assert grids["oversized_image"] == [[1, 2, 4]]  # 336x448 -> 28x56
    assert grids["tiny_image"] == [[1, 2, 2]]  # 6x8 -> 28x28


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skipped_samples_counted_in_the_main_process(
    hostile, tokenizer, caplog, num_workers
):
    """With workers, each worker's dataset skips; its batches carry the count home."""
    caplog.set_level("WARNING")
    loader = _loader(
        hostile.dataset_dir, "obelics", tokenizer, robust=True, num_workers=num_workers
    )
    batches = list(loader)
    skipped = {"corrupt_jpeg", "sliver_image", "cut_by_seq_len"}
    kinds = [hostile_kind(i, SMALL) for i in range(SMALL.num_samples)]
    assert len(batches) == SMALL.num_samples - loader.skipped_samples
    assert loader.skipped_samples == sum(kind in skipped for kind in kinds)
    if not num_workers:  # a worker's warnings do not reach caplog
        assert loader.skipped_samples == len(_skips(caplog))
    assert all(inputs.keys() == batches[0][0].keys() for inputs, _ in batches)


def test_corrupt_jpeg_in_a_cc12m_tar(tmp_path, tokenizer, caplog):
    """HF decodes a tar's jpg inside the iterator: upstream's run ends there."""
    (tmp_path / "tar").mkdir()
    shard = tmp_path / "tar" / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for index in range(3):
            jpg = _jpeg(index)
            for name, data in (
                (f"{index:04d}.jpg", jpg[: len(jpg) // 2] if index == 1 else jpg),
                (f"{index:04d}.txt", sample_spec(index).caption.encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    upstream = iter(_loader(shard.parent, "cc12m-test", tokenizer, robust=False))
    first_upstream, _ = next(upstream)
    with pytest.raises(OSError):
        next(upstream)

    caplog.set_level("WARNING")
    batches = list(_loader(shard.parent, "cc12m-test", tokenizer, robust=True))
    assert len(batches) == 2
    # Bytes decoded by torchvision equal upstream's PIL-decoded pixels.
    assert torch.equal(batches[0][0]["pixel_values"], first_upstream["pixel_values"])
    ((name, reason, count),) = _skips(caplog)
    assert name == f"{shard}:0001" and "truncated" in reason and count == 1


def test_a_raising_sample_processor_is_a_named_skip(tmp_path, tokenizer, caplog):
    # torchtitan joins a missing caption (None) into the text: TypeError.
    data = _parquet(
        tmp_path / "p",
        [[None, None], [None, sample_spec(1).caption]],
        [[_jpeg(0), None], [_jpeg(1), None]],
    )
    with pytest.raises(TypeError):
        list(_loader(data, "obelics", tokenizer, robust=False))
    caplog.set_level("WARNING")
    assert len(list(_loader(data, "obelics", tokenizer, robust=True))) == 1
    ((name, reason, count),) = _skips(caplog)
    assert (
        name == "#0 of dp rank 0's share"
        and reason.startswith("TypeError: ")
        and count == 1
    )


def test_data_without_a_good_sample_raises_instead_of_spinning(tmp_path, tokenizer):
    """torchtitan's infinite loader would warn forever and never yield a batch."""
    jpg = _jpeg(0)
    data = _parquet(
        tmp_path / "p",
        [[None, sample_spec(0).caption]] * 2,
        [[jpg[: len(jpg) // 2], None]] * 2,
    )
    loader = _loader(data, "obelics", tokenizer, robust=True, infinite=True)
    error = _first_batch_error(loader, "a good sample")
    assert isinstance(error, ValueError)
    assert "All 2 samples of dp rank 0's share of the dataset were skipped" in str(
        error
    )


@pytest.fixture
def _untyped():
    """One process, no device mesh: skip the spmd_types annotations."""
    previous = get_spmd_backend()
    set_spmd_backend("full_dtensor")
    yield
    set_spmd_backend(previous)


@pytest.mark.usefixtures("_untyped")
def test_placeholders_cut_by_the_collator_train_like_the_whole_sample(
    tmp_path, tokenizer
):
    """A loader that truncated instead of skipping: the cut run gets the image's
    first rows, so the kept positions see exactly what the whole sample gives.

    The hostile sample in small: BOS, 12 words, vision start, then the 4
    placeholders of a 56x56 image at 14..17, cut by a seq_len of 16.
    """
    words = " ".join((sample_spec(0).caption.split() * 2)[:12])
    data = _parquet(tmp_path / "p", [[words, None]], [[None, _jpeg(0)]])
    loader = _loader(data, "obelics", tokenizer, robust=False, seq_len=64)
    (sample,) = loader.dataset
    assert len(sample["input_ids"]) == 20
    whole = dataclasses.replace(loader.collate_fn, seq_len=20)
    cut = dataclasses.replace(loader.collate_fn, seq_len=16)
    (whole_inputs, _), (cut_inputs, _) = whole([sample]), cut([sample])
    is_image = cut_inputs["input"][0] == tokenizer.image_id
    assert is_image[-2:].all() and int(is_image.sum()) == 2  # 2 of 4 fit

    plugin = model_registry("debugmodel_mm").model.build()
    upstream = upstream_model_registry("debugmodel_mm").model.build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in plugin.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)
    upstream.load_state_dict(plugin.state_dict(), strict=True)
    geometry = VisionGeometry.of(plugin.config)

    def logits(model, inputs):
        check_vision_placeholders(
            inputs["input"],
            inputs["grid_thw"],
            image_id=tokenizer.image_id,
            spatial_merge_size=geometry.spatial_merge_size,
        )
        tokens, _, kwargs = post_process_with_vision_bank_indices(
            lambda i, labels: (
                i["input"],
                labels,
                {k: v for k, v in i.items() if k != "input"},
            ),
            inputs,
            inputs["input"],
            geometry,
        )
        masks = model.get_attention_masks(positions=kwargs["positions"])
        with torch.no_grad():
            return model(tokens, **kwargs, attention_masks=masks), kwargs

    whole_logits, _ = logits(plugin, whole_inputs)
    cut_logits, kwargs = logits(plugin, cut_inputs)
    assert kwargs["vision_bank_indices"][0, -2:].tolist() == [0, 1]
    torch.testing.assert_close(cut_logits, whole_logits[:, :16])

    up_kwargs = {k: v for k, v in cut_inputs.items() if k != "input"}
    masks = upstream.get_attention_masks(positions=cut_inputs["positions"])
    with pytest.raises(ValueError, match="vision_mask selects 2 positions"):
        upstream(cut_inputs["input"], **up_kwargs, attention_masks=masks)


def test_a_non_finite_pixel_is_a_named_skip(tmp_path, tokenizer, caplog, monkeypatch):
    """One NaN pixel in sample 1's image: upstream hands it to the encoder."""
    from torchtitan.hf_datasets.multimodal import mm_datasets

    process_image = mm_datasets.process_image
    calls = []

    def nan_in_the_second_image(*args, **kwargs):
        pixels = process_image(*args, **kwargs)
        calls.append(None)
        if len(calls) == 2:
            pixels[0, 3, 5, 1] = float("nan")  # (t, h, w, channel)
        return pixels

    monkeypatch.setattr(mm_datasets, "process_image", nan_in_the_second_image)
    texts = [[None, sample_spec(i).caption] for i in range(3)]
    data = _parquet(tmp_path / "p", texts, [[_jpeg(i), None] for i in range(3)])
    upstream = list(_loader(data, "obelics", tokenizer, robust=False))
    assert [b["pixel_values"].isnan().any().item() for b, _ in upstream] == [
        False,
        True,
        False,
    ]
    calls.clear()
    caplog.set_level("WARNING")
    assert len(list(_loader(data, "obelics", tokenizer, robust=True))) == 2
    assert _skips(caplog) == [
        (
            "#1 of dp rank 0's share",
            "pixel_values[0] has 1 non-finite values (NaN or inf)",
            1,
        )
    ]


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>"])
def test_a_caption_with_a_special_token_string_is_a_named_skip(
    tmp_path, tokenizer, caplog, token
):
    """Upstream tokenizes it into a forged placeholder or span marker."""
    caption = sample_spec(1).caption
    texts = [[None, sample_spec(0).caption], [None, f"{caption} {token} x"]]
    data = _parquet(tmp_path / "p", texts, [[_jpeg(i), None] for i in range(2)])
    special_id = tokenizer.encode(token)[0]
    upstream = list(_loader(data, "obelics", tokenizer, robust=False))
    assert len(upstream) == 2 and (upstream[1][0]["input"] == special_id).any()
    caplog.set_level("WARNING")
    assert len(list(_loader(data, "obelics", tokenizer, robust=True))) == 1
    assert _skips(caplog) == [
        (
            "#1 of dp rank 0's share",
            f"its text 'texts' contains the special token string(s) ['{token}']",
            1,
        )
    ]


def test_rows_over_the_image_cap_are_named_counted_skips(tmp_path, tokenizer, caplog):
    """Upstream's collator drops them with a warning that names and counts none."""
    texts = [[None, sample_spec(i).caption] for i in range(4)]
    data = _parquet(tmp_path / "p", texts, [[_jpeg(i), None] for i in range(4)])
    options = {"local_batch_size": 2, "max_images_per_batch": 1}
    caplog.set_level("WARNING")
    upstream = list(_loader(data, "obelics", tokenizer, robust=False, **options))
    assert sum("Removed sample" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    loader = _loader(data, "obelics", tokenizer, robust=True, **options)
    batches = list(loader)
    assert len(batches) == len(upstream) == 2
    for (got, _), (want, _) in zip(batches, upstream, strict=True):
        assert torch.equal(got["input"], want["input"])
        assert torch.equal(got["pixel_values"], want["pixel_values"])
    # Upstream's rule and words; a change to either fails here (nothing counted).
    reason = "Removed sample with 1 vision entries to keep total <= 1"
    skips = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipping")
    ]
    assert skips == [
        f"Skipping row 1 of a batch: {reason}. "
        f"Samples skipped so far on dp rank 0: {count}"
        for count in (1, 2)
    ]
    assert loader.skipped_samples == 2
    assert not any(r.getMessage().startswith("Removed") for r in caplog.records)


@pytest.mark.parametrize("member", ["txt", "json"])
def test_a_webdataset_member_that_does_not_decode_is_a_named_skip(
    tmp_path, tokenizer, caplog, member
):
    """HF decodes ``txt`` (UTF-8) and ``json`` inside its iterator: upstream's
    run ends there, at load when the sample is among the five it infers from."""
    samples = {f"{i:04d}": _members(i) for i in range(3)}
    shard = _tar(tmp_path / "bad" / "shard.tar", samples)
    good = _tar(
        tmp_path / "good" / "shard.tar", {k: samples[k] for k in ("0000", "0002")}
    )
    samples["0001"][member] = BAD_MEMBERS[member]
    _tar(shard, samples)
    decode, error = {
        "txt": (lambda: BAD_MEMBERS["txt"].decode(), UnicodeDecodeError),
        "json": (lambda: json.loads(BAD_MEMBERS["json"]), json.JSONDecodeError),
    }[member]
    with pytest.raises(error):
        list(_loader(shard.parent, "cc12m-test", tokenizer, robust=False))
    upstream = list(_loader(good.parent, "cc12m-test", tokenizer, robust=False))
    caplog.set_level("WARNING")
    batches = list(_loader(shard.parent, "cc12m-test", tokenizer, robust=True))
    assert _same_batches(batches, upstream) and len(batches) == 2
    assert _skip_messages(caplog) == [
        f"Skipping sample {shard}:0001: its member {member!r} does not decode: "
        f"{_error(decode)}. Samples skipped so far on dp rank 0: 1"
    ]


_DECLARED_FEATURES = """---
dataset_info:
  features:
  - name: __key__
    dtype: string
  - name: __url__
    dtype: string
  - name: jpg
    dtype: image
  - name: txt
    dtype: string
  - name: json
    struct:
    - name: key
      dtype: string
    - name: caption
      dtype: string
---
"""


def test_declared_features_reach_the_skip_handling_as_bytes(
    tmp_path, tokenizer, caplog
):
    """A card that declares the members' features (as the Hub exports cc12m's)
    skips HF's inference: HF then casts each member in its own iterator, where a
    caption that is not UTF-8 raised, and a JSON struct failed on raw bytes."""
    samples = {f"{i:04d}": _members(i) for i in range(3)}
    samples["0001"]["txt"] = BAD_MEMBERS["txt"]
    shard = _tar(tmp_path / "card" / "shard.tar", samples)
    (shard.parent / "README.md").write_text(_DECLARED_FEATURES)
    caplog.set_level("WARNING")
    batches = list(_loader(shard.parent, "cc12m-test", tokenizer, robust=True))
    assert len(batches) == 2
    assert _skip_messages(caplog) == [
        f"Skipping sample {shard}:0001: its member 'txt' does not decode: "
        f"{_error(lambda: BAD_MEMBERS['txt'].decode())}. "
        "Samples skipped so far on dp rank 0: 1"
    ]


@pytest.mark.parametrize("cut_shard", [0, 1])
def test_a_tar_cut_short_skips_the_rest_of_its_shard(
    tmp_path, tokenizer, caplog, cut_shard
):
    """Upstream's run ends at the cut (at load when HF infers from that shard).
    The plug-in trains what precedes it, names the shard and its last whole
    sample, and reads the next shard: as upstream reads the shard ending there."""
    samples = {f"{i:04d}": _members(i) for i in range(6)}
    keys = [["0000", "0001", "0002"], ["0003", "0004", "0005"]]
    last_whole, cut_in = keys[cut_shard][:2]
    shards = []
    for n, shard in enumerate(keys):
        cut = n == cut_shard
        path = tmp_path / "cut" / f"s{n}.tar"
        shards.append(
            _tar(path, {k: samples[k] for k in shard}, cut_in if cut else None)
        )
        whole = [last_whole] if cut else shard  # the cut shard, ending at its cut
        _tar(tmp_path / "whole" / f"s{n}.tar", {k: samples[k] for k in whole})
    with pytest.raises(tarfile.ReadError):
        list(_loader(shards[0].parent, "cc12m-test", tokenizer, robust=False))
    upstream = list(_loader(tmp_path / "whole", "cc12m-test", tokenizer, robust=False))
    caplog.set_level("WARNING")
    batches = list(_loader(shards[0].parent, "cc12m-test", tokenizer, robust=True))
    assert _same_batches(batches, upstream) and len(batches) == 4
    assert _skip_messages(caplog) == [
        f"Skipping the rest of shard {shards[cut_shard]} after sample "
        f"{last_whole}: it is cut short ({_cut_error(shards[cut_shard])}). "
        "Samples skipped so far on dp rank 0: 1"
    ]


def test_a_first_shard_without_a_whole_sample_is_named_at_load(tmp_path, tokenizer):
    """HF infers the features from the first shard: upstream's ReadError names
    no shard, and with members left undecoded pyarrow's would name none either."""
    shard = _tar(tmp_path / "d" / "s0.tar", {"0000": _members(0)}, cut_in="0000")
    _tar(tmp_path / "d" / "s1.tar", {"0001": _members(1)})
    with pytest.raises(tarfile.ReadError):
        _loader(shard.parent, "cc12m-test", tokenizer, robust=False)
    with pytest.raises(ValueError, match=f"{shard} is cut short before its first"):
        _loader(shard.parent, "cc12m-test", tokenizer, robust=True)


def test_a_share_of_shards_cut_before_a_sample_raises_instead_of_spinning(
    tmp_path, tokenizer
):
    """dp rank 1 reads shard 1 alone, cut inside its first sample: each pass of
    the infinite loop would skip it again and never yield a batch."""
    _tar(tmp_path / "d" / "s0.tar", {"0000": _members(0)})
    _tar(tmp_path / "d" / "s1.tar", {"0001": _members(1)}, cut_in="0001")
    loader = _loader(
        tmp_path / "d",
        "cc12m-test",
        tokenizer,
        robust=True,
        infinite=True,
        dp_world_size=2,
        dp_rank=1,
    )
    error = _first_batch_error(loader, "a whole sample")
    assert isinstance(error, ValueError)
    assert "dp rank 1's share of the dataset holds no whole sample: the 1 " in str(
        error
    )


@pytest.mark.parametrize("after", [3, 5])
def test_a_resumed_loader_meets_a_cut_shard_as_the_uninterrupted_one(
    tmp_path, tokenizer, caplog, after
):
    """HF's state counts the cut shard as one that ended at the cut: batches 3
    and 5 hold 0004 (before the cut) and 0008 (after it)."""
    data, _ = hostile_webdataset(tmp_path / "d")
    uninterrupted = list(_loader(data, "cc12m-test", tokenizer, robust=True))
    source = _loader(data, "cc12m-test", tokenizer, robust=True)
    batches = iter(source)
    for _ in range(after):
        next(batches)
    resumed = _loader(data, "cc12m-test", tokenizer, robust=True)
    resumed.load_state_dict(source.state_dict())
    caplog.clear()
    caplog.set_level("WARNING")
    assert _same_batches(list(resumed), uninterrupted[after:])
    cuts = [m for m in _skip_messages(caplog) if m.startswith("Skipping the rest")]
    # Resumed before the cut, the loader meets it once; HF resumes from a state
    # up to two samples back, so one resumed just after it may meet it again.
    assert len(cuts) == 1 if after == 3 else len(cuts) <= 1, cuts


@pytest.mark.parametrize("num_workers", [0, 2])
def test_webdataset_skips_counted_in_the_main_process(
    tmp_path, tokenizer, caplog, num_workers
):
    """With two workers, one reads shards 0 and 2, the other the cut shard 1."""
    data, expected = hostile_webdataset(tmp_path / "d")
    caplog.set_level("WARNING")
    loader = _loader(
        data, "cc12m-test", tokenizer, robust=True, num_workers=num_workers
    )
    batches = list(loader)
    assert len(batches) == 6 and loader.skipped_samples == len(expected)
    if not num_workers:  # a worker's warnings do not reach caplog
        assert _skip_messages(caplog) == expected


def test_members_decode_as_hf_decodes_them(tmp_path):
    """HF's builder and ``decode_members`` give the same values, also for a
    member HF decompresses first and one its features type as an integer."""
    extra = {"cls": b"3", "txt.gz": gzip.compress(b"two shapes on gray")}
    _tar(
        tmp_path / "d" / "s.tar", {f"{i:04d}": {**_members(i), **extra} for i in (0, 1)}
    )

    def load():
        return load_dataset(
            str(tmp_path / "d"), split="train", data_files="*.tar", streaming=True
        ).decode(False)

    hf = list(load())
    with members_undecoded():
        undecoded = list(load())
    assert {type(x["txt.gz"]) for x in undecoded} == {bytes}
    assert [decode_members(x) for x in undecoded] == hf


def test_a_wrapped_webdataset_stream_still_reports_its_cut_shards(tmp_path):
    """A loader of one's own that shuffles (or maps, filters) the stream: the
    builder is found under the wrapping iterables, not refused."""
    _tar(tmp_path / "d" / "s.tar", {f"{i:04d}": _members(i) for i in range(3)})
    with members_undecoded():
        stream = load_dataset(
            str(tmp_path / "d"), split="train", data_files="*.tar", streaming=True
        )
    cuts = []
    report_cut_shards(stream.shuffle(seed=0, buffer_size=2), cuts.append)
    examples = stream._ex_iterable
    assert examples.generate_examples_fn.__self__.on_cut_shard == cuts.append


# datasets 4.7.0's code that UndecodedWebDataset and members_undecoded rely on:
# name -> sha256 of its source (inspect.getsource's text).
_DATASETS_PINS = {
    "WebDataset._get_pipeline_from_tar": (
        "b88ff3bc2ddc92186ec261b67ea718e31c0974c5fa66c2fde87a2b087b8624c8"
    ),
    "WebDataset._split_generators": (
        "9e45f7242de8370d4111a496d61e94cb5db1bb6d0016421b27a3f366d2c05f11"
    ),
    "WebDataset._generate_examples": (
        "f2af4436246256d3d3e5a7c3ad4b11f7b46cfc224f159dd56475d52effc6ef4e"
    ),
    "import_main_class": (
        "8c28c2352828378b926726b9b2382b5f5e76bc6d6ad9d431c72458eefa24eb6e"
    ),
}


def test_the_hf_webdataset_code_the_plugin_hooks_is_pinned():
    """The hooks hold on what these functions do; a change fails here first."""
    hf_builder = UndecodedWebDataset.__bases__[0]
    functions = [
        hf_builder._get_pipeline_from_tar,
        hf_builder._split_generators,
        hf_builder._generate_examples,
        datasets_load.import_main_class,
    ]
    pins = {
        f.__qualname__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()
        for f in functions
    }
    assert pins == _DATASETS_PINS, (
        f"datasets {datasets.__version__} changed what the plug-in's webdataset "
        "hooks rely on (torchtitan_ext/muse_glimmer/webdataset.py); re-check that "
        "_get_pipeline_from_tar still decodes with cls.DECODERS, is called on "
        "the builder (self.) to infer the features and to stream, and raises a cut "
        "tar's tarfile.ReadError; that import_main_class still takes the module's "
        "WebDataset; then re-pin _DATASETS_PINS."
    )
    with pytest.raises(RuntimeError), members_undecoded():
        assert hf_webdataset.WebDataset is UndecodedWebDataset
        raise RuntimeError
    assert hf_webdataset.WebDataset is hf_builder  # restored, also on an error
