"""HF's webdataset builder, its tar members left bytes and a cut-short shard ended.

HF's ``WebDataset`` builder decodes a sample's ``txt`` and ``json`` members (any
of its ``DECODERS``) inside its shard generator, and a tar cut short raises there
too: a caption that is not UTF-8, a JSON member that does not parse or a
truncated shard ends the generator, and the job, before the sample processor
sees the sample. ``UndecodedWebDataset`` keeps every member bytes
(``decode_members`` applies HF's decoders where ``SampleSkipper`` makes a failure
a named skip) and ends a shard where it breaks, telling ``on_cut_shard``. HF's
stream then reads the next shard, and its resume state (shard, example in the
shard) counts as for a shard that ended there.
"""

import contextlib
import importlib
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

import datasets
from datasets import IterableDataset
from datasets.utils.file_utils import SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL

__all__ = [
    "UndecodedWebDataset",
    "decode_members",
    "members_undecoded",
    "report_cut_shards",
]

# The module, not the package of that name (whose name datasets rebinds to it).
hf_webdataset = importlib.import_module(
    "datasets.packaged_modules.webdataset.webdataset"
)
_HFWebDataset = hf_webdataset.WebDataset

CutShardReport = Callable[[str, str | None, Exception], None]
"""Told ``(shard, key of its last whole sample or None, error)``."""


class UndecodedWebDataset(_HFWebDataset):
    """HF's webdataset builder: members stay bytes; a shard ends where it is cut."""

    DECODERS = {}  # HF's _get_pipeline_from_tar decodes with cls.DECODERS

    on_cut_shard: CutShardReport | None = None
    """Unset while ``load_dataset`` infers the features from the first shard's
    first samples: a cut there ends the shard (the stream meets it again), or,
    before the shard's first whole sample, is an error naming the shard."""

    def _split_generators(self, dl_manager):
        """HF's, the decoded members' declared features made bytes.

        Features declared up front (a dataset card's ``dataset_info``, the Hub's
        exported ones, ``load_dataset(features=...)``) skip HF's inference, and
        HF casts each member to them in its own iterator: a ``txt: string``
        would fail there on bytes that are not UTF-8, a struct on raw JSON.
        """
        splits = super()._split_generators(dl_manager)
        features = self.info.features
        for field in list(features or {}):
            if _decoder_key(field) in _HFWebDataset.DECODERS:
                features[field] = datasets.Value("binary")
        return splits

    def _get_pipeline_from_tar(self, tar_path, tar_iterator):
        # HF's classmethod, called on the builder both to infer and to stream.
        key = None
        try:
            for example in super()._get_pipeline_from_tar(tar_path, tar_iterator):
                key = example["__key__"]
                yield example
        except Exception as error:  # not GeneratorExit: a closed generator raises it
            if not isinstance(error, tarfile.ReadError):  # "unexpected end of data"
                raise
            if self.on_cut_shard is not None:
                self.on_cut_shard(tar_path, key, error)
            elif key is None:
                raise ValueError(
                    f"{tar_path} is cut short before its first whole sample "
                    f"({error}): HF infers a webdataset's features from the first "
                    "shard's first samples, so that shard must hold one."
                ) from error


@contextlib.contextmanager
def members_undecoded() -> Iterator[None]:
    """``load_dataset`` builds a webdataset with ``UndecodedWebDataset`` while open.

    HF takes the builder from its packaged module's ``WebDataset`` at each load
    (``datasets.load.import_main_class``) and has no option to name another, so
    the name is swapped for the loader's one call (process-wide: the loader is
    built on one thread, with no other load under way).
    """
    previous, hf_webdataset.WebDataset = hf_webdataset.WebDataset, UndecodedWebDataset
    try:
        yield
    finally:
        hf_webdataset.WebDataset = previous


def report_cut_shards(stream: IterableDataset, report: CutShardReport) -> None:
    """Tell ``report`` of each shard of ``stream`` cut short, if it is a webdataset."""
    if stream.info.builder_name != "webdataset":
        return
    examples = stream._ex_iterable
    while hasattr(examples, "ex_iterable"):  # shuffled, mapped, filtered, ...
        examples = examples.ex_iterable
    generate = getattr(examples, "generate_examples_fn", None)
    builder = getattr(generate, "__self__", None)
    if not isinstance(builder, UndecodedWebDataset):
        raise RuntimeError(
            f"datasets {datasets.__version__} built this webdataset with "
            f"{type(builder).__name__}, not UndecodedWebDataset (the "
            "members_undecoded hook no longer holds): a bad member or a cut "
            "shard would end the job; see tests/unit/test_hostile_data.py."
        )
    builder.on_cut_shard = report


def _decoder_key(field: str) -> str:
    """HF's decoder key of a member: its last extension, or the one before a
    compression extension (``txt.gz``: HF decompresses it, then decodes it)."""
    *rest, last = field.lower().split(".")
    compressed = rest and last in SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL
    return rest[-1] if compressed else last


def decode_members(sample: dict[str, Any]) -> dict[str, Any]:
    """A webdataset sample's members decoded as HF's builder decodes them.

    A sample of another builder (no ``__key__`` and ``__url__``) and values
    that are not bytes come back unchanged. Raises ``ValueError`` naming the
    member that does not decode.
    """
    if "__key__" not in sample or "__url__" not in sample:
        return sample
    decoded = dict(sample)
    for field, value in sample.items():
        decoder = _HFWebDataset.DECODERS.get(_decoder_key(field))
        if decoder is None or not isinstance(value, bytes):
            continue
        try:
            decoded[field] = decoder(value)
        except Exception as error:
            raise ValueError(
                f"its member {field!r} does not decode: {type(error).__name__}: {error}"
            ) from error
    return decoded
