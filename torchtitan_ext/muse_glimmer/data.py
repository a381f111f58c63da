"""torchtitan's multimodal loader, skipping bad samples by name and counting them.

torchtitan 0.3.0's ``MMDataLoader`` already resizes images into the pixel
budget (an oversized or sub-patch image trains as intended), and drops a sample
whose image does not decode or whose tokens exceed ``seq_len``, so a sample
whose image placeholders would be cut never reaches the collator. What it lacks:

- HF's webdataset builder decodes a cc12m ``jpg`` with PIL inside the dataset
  iterator, so one corrupt JPEG raises out of the loader and ends the run. Here
  the images stay undecoded bytes, which torchtitan's ``process_image`` decodes
  inside its own error handling.
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
from torchtitan.tools.logging import logger

__all__ = ["RobustMMDataLoader", "SampleSkipper"]


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
    ) -> None:
        self._process = process
        self._dataset = dataset
        self._dp_rank = dp_rank
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
        for record in held.records:  # a kept sample's warnings, unchanged
            logger.handle(record)
        self._kept_this_pass += 1
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


class _ResumedOnce:
    """An HF stream that starts at a loaded state for one pass, not for every pass.

    HF's ``IterableDataset`` re-applies a loaded state on each ``__iter__`` of
    the saved epoch, and torchtitan's infinite loop never advances the epoch. So
    after a resume each later pass replayed only the tail of a rank's data (the
    run diverged from the uninterrupted one) and, when the checkpoint was taken
    at the end of that data, yielded nothing, forever: the job hung.
    """

    def __init__(self, stream: IterableDataset) -> None:
        self._stream = stream

    def __iter__(self):
        yield from self._stream
        self._stream._starting_state_dict = None  # HF has no public way to drop it

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
        super().__init__(config, **kwargs)
        dataset = self.dataset
        if isinstance(dataset._data, IterableDataset):
            dataset._data = _ResumedOnce(dataset._data.decode(False))
        dataset.sample_processor = SampleSkipper(
            dataset.sample_processor, dataset, dp_rank=self.dp_rank
        )
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
