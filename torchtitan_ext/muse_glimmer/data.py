"""torchtitan's multimodal loader, skipping bad samples by name and counting them.

torchtitan 0.3.0's ``MMDataLoader`` already resizes images into the pixel
budget (an oversized or sub-patch image trains as intended), and drops a sample
whose image does not decode or whose tokens exceed ``seq_len``, so a sample
whose image placeholders would be cut never reaches the collator. What it lacks:

- HF's webdataset builder decodes a cc12m ``jpg`` with PIL inside the dataset
  iterator, so one corrupt JPEG raises out of the loader and ends the run. Here
  the images stay undecoded bytes, which torchtitan's ``process_image`` decodes
  inside its own error handling.
- The builder decodes ``txt`` and ``json`` members there too, and a tar cut
  short raises there: a caption that is not UTF-8, a JSON member that does not
  parse or a truncated shard ends the run. Here (``webdataset.py``) members stay
  bytes until ``SampleSkipper`` decodes them, a failure a skip like the others,
  and a cut shard is one skip naming it and its last whole sample; the next
  shard is read.
- Its warnings name neither the sample nor how many were skipped, and an
  exception in the sample processor (a cc12m record without a ``txt``) ends the
  run. Here each skip is one warning with the sample's key (or its position in
  this rank's stream), the reason, and the running count.
- A dataset whose every sample is skipped loops forever without a batch: the
  run hangs. Here a full pass without one sample kept is an error.
- After a resume, every pass of its infinite loop restarts at the checkpointed
  position instead of the start (see ``_ResumedOnce``). Here only the first
  pass does, as in the uninterrupted run.
- Nothing counts the skipped samples for the metrics. Here the loader's
  ``skipped_samples`` does, also when worker processes do the skipping.
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from datasets import IterableDataset
from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator
from torchtitan.hf_datasets.multimodal.mm_datasets import (
    HuggingFaceMultiModalDataset,
    MMDataLoader,
)
from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker
from torchtitan.tools.logging import logger

from .batch_agreement import SAMPLE_DIGESTS, sample_digest
from .webdataset import decode_members, members_undecoded, report_cut_shards

__all__ = ["RobustMMDataLoader", "SampleSkipper", "vision_entries"]


class _HeldWarnings(logging.Filter):
    """Holds back the warnings this thread logs on torchtitan's (root) logger."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.thread != self._thread:
            return True
        self.records.append(record)
        return False


def _undecoded(value: Any) -> Any:
    """An HF image left undecoded (``{"bytes", "path"}``) as what torchtitan reads."""
    if isinstance(value, dict) and value.keys() == {"bytes", "path"}:
        return value["bytes"] if value["bytes"] is not None else value["path"]
    if isinstance(value, list):
        return [_undecoded(item) for item in value]
    return value


def _special_token_text(sample: dict[str, Any], tokenizer) -> str | None:
    """Why a sample's text holds a special token string, if it does.

    The tokenizer turns a caption's ``<|image_pad|>`` into a placeholder with no
    image behind it (the batch check then ends the run, at the same step after
    every restart); other special strings forge the vision span markers or end
    the document early.
    """
    names = [f"{name}_token" for name in tokenizer.TOKEN_FIELDS]
    specials = sorted(
        {
            token
            for name in (*names, "bos_token", "eos_token")
            if (token := getattr(tokenizer, name, None))
        }
    )
    for key, value in sample.items():
        if key.startswith("__"):  # webdataset's key and url
            continue
        for text in value if isinstance(value, list) else [value]:
            found = [
                token for token in specials if isinstance(text, str) and token in text
            ]
            if found:
                return f"its text {key!r} contains the special token string(s) {found}"
    return None


def _non_finite_pixels(processed: dict[str, Any]) -> str | None:
    """Why a processed sample's pixels are not all finite, if they are not.

    One NaN pixel makes the image's features and the encoder's gradient NaN;
    torchtitan notices at a logging step, after the update, without the sample.
    """
    for key in ("pixel_values", "pixel_values_videos"):
        for index, pixels in enumerate(processed.get(key) or []):
            bad = int((~torch.isfinite(pixels)).sum())
            if bad:
                return f"{key}[{index}] has {bad} non-finite values (NaN or inf)"
    return None


def vision_entries(sample: dict[str, Any], temporal_patch_size: int) -> int:
    """A sample's count against ``max_images_per_batch``, as the collator counts."""
    videos = sample.get("pixel_values_videos") or []
    return len(sample.get("pixel_values") or []) + sum(
        video.shape[0] // temporal_patch_size for video in videos
    )


class SampleSkipper:
    """Wraps a dataset's ``sample_processor``: a bad sample is skipped by name.

    Called by ``HuggingFaceMultiModalDataset.__iter__`` once per raw sample,
    after it has counted the sample in ``_sample_idx``. Every rank of a CP or TP
    group reads the same samples, so all of them skip the same ones and raise
    the same error.
    """

    def __init__(
        self,
        process: Callable[..., dict[str, Any] | None],
        dataset: HuggingFaceMultiModalDataset,
        *,
        dp_rank: int,
        max_images: int | None = None,
    ) -> None:
        self._process = process
        self._dataset = dataset
        self._dp_rank = dp_rank
        self._max_images = max_images
        self.skipped = 0
        """Samples skipped by this process's loader so far."""
        self._pass_is_full = False
        self._kept_this_pass = 0
        self._skipped_this_pass = 0

    def __call__(self, *, sample: dict[str, Any], seq_len: int, **kwargs):
        position = self._dataset._sample_idx - 1
        if position == 0:
            self._start_pass()
        sample = {key: _undecoded(value) for key, value in sample.items()}
        if (sample := self._members_decoded(sample, position)) is None:
            return None
        reason = _special_token_text(sample, kwargs["tokenizer"])
        if reason:
            self._skip(sample, position, reason)
            return None
        held = _HeldWarnings()
        logger.addFilter(held)
        try:
            processed = self._process(sample=sample, seq_len=seq_len, **kwargs)
            reason = "; ".join(r.getMessage() for r in held.records)
        except Exception as error:
            processed, reason = None, f"{type(error).__name__}: {error}"
        finally:
            logger.removeFilter(held)
        if processed is None:
            self._skip(sample, position, reason or "rejected by the sample processor")
            return None
        num_tokens = processed["input_ids"].shape[0]
        if num_tokens > seq_len:
            image_id = kwargs["tokenizer"].image_id
            cut = int((processed["input_ids"][seq_len:] == image_id).sum())
            reason = f"{num_tokens} tokens exceed training.seq_len {seq_len}"
            if cut:
                reason += f", {cut} image placeholder tokens among them"
            self._skip(sample, position, reason)
            return None
        reason = _non_finite_pixels(processed)
        if reason:
            self._skip(sample, position, reason)
            return None
        images = vision_entries(processed, kwargs["temporal_patch_size"])
        if self._max_images is not None and images > self._max_images:
            reason = (
                f"its {images} vision entries exceed "
                f"dataloader.max_images_per_batch {self._max_images}"
            )
            self._skip(sample, position, reason)
            return None
        for record in held.records:  # a kept sample's warnings, unchanged
            logger.handle(record)
        self._kept_this_pass += 1
        processed[SAMPLE_DIGESTS] = [sample_digest(sample)]
        return processed

    def _start_pass(self) -> None:
        if self._pass_is_full and self._skipped_this_pass and not self._kept_this_pass:
            raise ValueError(
                f"All {self._skipped_this_pass} samples of dp rank {self._dp_rank}'s "
                "share of the dataset were skipped (see the warnings above): "
                "no batch can be built from it."
            )
        self._pass_is_full = True
        self._kept_this_pass = self._skipped_this_pass = 0

    def skip_row(self, row: int, reason: str) -> None:
        """A collated row dropped whole (it may pack several samples)."""
        self.skipped += 1
        logger.warning(
            f"Skipping row {row} of a batch: {reason}. "
            f"Samples skipped so far on dp rank {self._dp_rank}: {self.skipped}"
        )

    def skip_shard(self, shard: str, last_key: str | None, error: Exception) -> None:
        """The rest of a shard cut short, one skip: the sample it cut (how many
        followed is unknown). HF's stream goes on with the next shard."""
        self.skipped += 1
        self._skipped_this_pass += 1
        after = "from its start" if last_key is None else f"after sample {last_key}"
        logger.warning(
            f"Skipping the rest of shard {shard} {after}: it is cut short "
            f"({type(error).__name__}: {error}). "
            f"Samples skipped so far on dp rank {self._dp_rank}: {self.skipped}"
        )

    def _members_decoded(
        self, sample: dict[str, Any], position: int
    ) -> dict[str, Any] | None:
        """``sample`` with its webdataset members decoded; None if one does not
        (a caption that is not UTF-8, a JSON member that does not parse)."""
        try:
            return decode_members(sample)
        except ValueError as error:
            self._skip(sample, position, str(error))
            return None

    def _skip(self, sample: dict[str, Any], position: int, reason: str) -> None:
        self.skipped += 1
        self._skipped_this_pass += 1
        if "__key__" in sample:
            name = f"{sample.get('__url__', '')}:{sample['__key__']}"
        else:
            name = f"#{position} of dp rank {self._dp_rank}'s share"
        logger.warning(
            f"Skipping sample {name}: {reason}. "
            f"Samples skipped so far on dp rank {self._dp_rank}: {self.skipped}"
        )


class _ImageCappedPacker(MMSamplePacker):
    """torchtitan's packer, also bounding each packed row's vision entries.

    Upstream packs by tokens alone, so one row of a long sequence can hold more
    than ``max_images_per_batch`` images; the collator then removes rows until
    the batch fits, and at one row a batch (every long-context job) removes all
    of them and fails on an empty list. Its scan-and-pick loop has no hook for a
    second bound, so ``_pack_buffered_samples`` is that loop with the image bound
    added (``tests/unit/test_upstream_guards.py`` pins upstream's). A sample
    over the bound alone never gets here (``SampleSkipper`` skips it), so every
    buffered sample fits an empty row. Rows keep their samples' digests.
    """

    def __init__(self, packer: MMSamplePacker, *, max_images: int, temporal: int):
        super().__init__(packer.max_seq_length, packer.buffer_size, packer.batch_size)
        self.max_images = max_images
        self._temporal = temporal

    def _pack_buffered_samples(self, flush: bool = False) -> None:
        while self._sample_buffer:
            picked, length, images, capped = [], 0, 0, False
            for sid, sample in self._sample_buffer.items():
                tokens = len(sample["input_ids"])
                entries = vision_entries(sample, self._temporal)
                if length + tokens > self.max_seq_length:
                    continue
                if images + entries > self.max_images:
                    capped = True  # it fits the tokens: only the bound keeps it out
                    continue
                picked.append(sid)
                length += tokens
                images += entries
            assert picked, "SampleSkipper lets no sample over a row's bounds through"
            # A row the bound keeps from growing is full: waiting for a sample
            # with fewer images (documents of 3 at a cap of 64) may never end.
            full = length == self.max_seq_length or capped
            if not flush and not full:  # kept for later samples, as upstream does
                break
            samples = [self._sample_buffer.pop(sid) for sid in picked]
            self.packed_samples.append(self._merge_samples(samples))

    @staticmethod
    def _merge_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
        merged = MMSamplePacker._merge_samples(samples)
        if all(SAMPLE_DIGESTS in s for s in samples):  # restored ones have none
            merged[SAMPLE_DIGESTS] = [d for s in samples for d in s[SAMPLE_DIGESTS]]
        return merged


class _ResumedOnce:
    """An HF stream that starts at a loaded state for one pass, not for every pass.

    HF's ``IterableDataset`` re-applies a loaded state on each ``__iter__`` of
    the saved epoch, and torchtitan's infinite loop never advances the epoch. So
    after a resume each later pass replayed only the tail of a rank's data (the
    run diverged from the uninterrupted one) and, when the checkpoint was taken
    at the end of that data, yielded nothing, forever: the job hung.

    A full pass that yields nothing because every shard read was cut short
    before a whole sample is an error, not another pass: the same hang.
    """

    def __init__(self, stream: IterableDataset) -> None:
        self._stream = stream
        self._skipper: SampleSkipper | None = None
        self._dp_rank = 0

    def report_to(self, skipper: SampleSkipper, *, dp_rank: int) -> None:
        """``skipper`` names and counts each shard of the stream cut short."""
        self._skipper, self._dp_rank = skipper, dp_rank
        report_cut_shards(self._stream, skipper.skip_shard)

    def __iter__(self):
        full = not self._stream._starting_state_dict
        skipped = self._skipper.skipped if self._skipper else 0
        empty = True
        for sample in self._stream:
            empty = False
            yield sample
        self._stream._starting_state_dict = None  # HF has no public way to drop it
        cut = self._skipper.skipped - skipped if self._skipper else 0
        if full and empty and cut:
            raise ValueError(
                f"dp rank {self._dp_rank}'s share of the dataset holds no whole "
                f"sample: the {cut} shard(s) read were cut short before their "
                "first (see the warnings above), so no batch can be built from it."
            )

    def state_dict(self) -> dict[str, Any]:
        return self._stream.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stream.load_state_dict(state_dict)


_SKIPPED_KEY = "_skipped_since_last_batch"
# MultiModalCollator.__call__'s warning for each row over the image cap.
_CAP_WARNING = "Removed sample with "


class _CountingCollator:
    """The collator, adding to each batch the samples skipped since the last one.

    With ``num_workers > 0`` the dataset, and with it ``SampleSkipper.skipped``,
    lives in each worker process; the batch is the one thing that comes back.
    A count since this process's previous batch adds up across workers (and
    across worker restarts) in the main process.
    """

    def __init__(self, collate: MultiModalCollator, skipper: SampleSkipper) -> None:
        self._collate = collate
        self._skipper = skipper
        self._reported = 0

    def __call__(self, samples: list[dict[str, Any]]):
        """Upstream's collation; each row its image cap drops a named, counted skip.

        Upstream drops rows from the end while the batch holds more than
        ``max_images_per_batch`` images, with a warning that names no row and
        counts nowhere: held back here and reported as the other skips are.
        """
        rows = len(samples)
        held = _HeldWarnings()
        logger.addFilter(held)
        try:
            input_dict, labels = self._collate(samples)
        finally:
            logger.removeFilter(held)
        for record in held.records:
            message = record.getMessage()
            if message.startswith(_CAP_WARNING):
                rows -= 1
                self._skipper.skip_row(rows, message)
            else:
                logger.handle(record)
        kept = samples[:rows]
        if all(sample.get(SAMPLE_DIGESTS) for sample in kept):  # not restored rows
            input_dict[SAMPLE_DIGESTS] = torch.tensor(
                [d for sample in kept for d in sample[SAMPLE_DIGESTS]],
                dtype=torch.int64,
            )
        skipped = self._skipper.skipped
        input_dict[_SKIPPED_KEY] = skipped - self._reported
        self._reported = skipped
        return input_dict, labels


class RobustMMDataLoader(MMDataLoader):
    """torchtitan's ``MMDataLoader`` whose dataset skips bad samples by name."""

    @dataclass(kw_only=True, slots=True)
    class Config(MMDataLoader.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        with members_undecoded():  # a bad member or a cut tar: a skip, see there
            super().__init__(config, **kwargs)
        dataset = self.dataset
        if isinstance(dataset._data, IterableDataset):
            dataset._data = _ResumedOnce(dataset._data.decode(False))
        dataset.sample_processor = SampleSkipper(
            dataset.sample_processor,
            dataset,
            dp_rank=self.dp_rank,
            max_images=config.max_images_per_batch,
        )
        if dataset.enable_packing:
            dataset.packer = _ImageCappedPacker(
                dataset.packer,
                max_images=config.max_images_per_batch,
                temporal=config.temporal_patch_size,
            )
        if isinstance(dataset._data, _ResumedOnce):
            dataset._data.report_to(dataset.sample_processor, dp_rank=self.dp_rank)
        self.collate_fn = _CountingCollator(self.collate_fn, dataset.sample_processor)
        self.skipped_samples = 0
        """Samples of this dp rank's share skipped before the batches yielded so far."""

    def __iter__(self):
        # Upstream's iterator now, not at the first batch: it loads a restored state.
        return self._counted(super().__iter__())

    def _counted(self, batches):
        for input_dict, labels in batches:
            self.skipped_samples += input_dict.pop(_SKIPPED_KEY)
            yield input_dict, labels
