"""The ranks that must hold the same batch prove it, before any collective sized by it.

The CP, TP and PP ranks of one data-parallel index read the same samples and
must train on the same batch. Nothing in torchtitan checks that they do: a
rank whose image fetch timed out or whose sample processor skipped one sample
trains on silently with replicated vision (every shape still matches), and
hands sharded vision's exchange sizes its peers do not expect. Each rank
fingerprints its CPU batch (token and image counts, the image grids, a digest
of the tokens, labels and its samples' digests) and the group all-gathers the
fingerprints over a gloo process group of its own: host memory only, no device
sync. Every rank of the group then sees the same fingerprints and raises the
same error.

The pixels are the batch at real image sizes (64 photos of 54x72 patches are
1.2 GB of float32), so the training thread never hashes them: the loader digests
each raw sample where it is read (``sample_digest``: its key and its encoded
bytes, tens of times smaller than the decoded pixels) and the batch carries the
digests of its samples (``SAMPLE_DIGESTS``; a batch holding rows restored from
a checkpoint of an older loader has none, and its pixels are hashed). What that
cannot see: two ranks that decode the same bytes into different pixels of the
same grid (an unseeded random augmentation, another libjpeg on one node), or,
for a sample that names its image (a URL or a path) instead of holding its
bytes, two ranks that fetch different bytes from that name.
The group keeps torchtitan's timeouts (``comm``: the init timeout until its
first check has passed, the train timeout after), which torchtitan sets on its
own groups only: a new group would wait gloo's 30-minute default.
"""

import hashlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.config import CommConfig
from torchtitan.distributed import ParallelDims

__all__ = ["SAMPLE_DIGESTS", "BatchAgreement", "batch_fingerprint", "sample_digest"]

FIELDS = ("tokens", "images", "grids", "content")
SAMPLE_DIGESTS = "sample_digests"
"""A batch's int64 [S] digests of its S samples, in row order (a loader's key)."""


def _digest_of(digest, value: Any) -> None:
    """Feed ``value``'s bytes to ``digest``: the same on every rank that holds it."""
    if isinstance(value, torch.Tensor):
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        digest.update(memoryview(value.contiguous().view(-1).view(torch.uint8).numpy()))
    elif isinstance(value, bytes | bytearray | memoryview):
        digest.update(b"b%d:" % len(value))
        digest.update(value)
    elif isinstance(value, list | tuple):
        digest.update(b"[%d" % len(value))
        for item in value:
            _digest_of(digest, item)
    elif isinstance(value, dict):
        digest.update(b"{%d" % len(value))
        for key in sorted(value):
            _digest_of(digest, key)
            _digest_of(digest, value[key])
    elif isinstance(value, str | int | float | bool | None):
        digest.update(f"{type(value).__name__}:{value!s};".encode())
    elif hasattr(value, "tobytes"):  # a decoded image or array
        digest.update(type(value).__name__.encode())
        digest.update(value.tobytes())
    else:  # no stable bytes (a str() may hold an address): its type alone
        digest.update(f"{type(value).__qualname__};".encode())


def _digest(value: Any) -> int:
    """A 63-bit digest of ``value``'s bytes (a tensor's shape and dtype included)."""
    digest = hashlib.blake2b(digest_size=8)
    _digest_of(digest, value)
    return int.from_bytes(digest.digest(), "little") >> 1


def sample_digest(sample: dict[str, Any]) -> int:
    """A raw sample's digest, before decoding: its key and its encoded members.

    Not its ``__url__``: nodes may mount the same shards at other paths.
    """
    return _digest({k: v for k, v in sample.items() if k != "__url__"})


def batch_fingerprint(input_dict: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
    """``FIELDS`` of a CPU batch, as an int64 tensor.

    Its content digest reads the tokens, the labels and the samples' digests; a
    batch from a loader that digests no samples has its pixels hashed instead.
    """
    grid_thw_N3 = input_dict.get("grid_thw")
    samples = input_dict.get(SAMPLE_DIGESTS)
    return torch.tensor(
        [
            input_dict["input"].numel(),
            0 if grid_thw_N3 is None else grid_thw_N3.shape[0],
            _digest(grid_thw_N3),
            _digest(
                [
                    input_dict["input"],
                    labels,
                    input_dict.get("pixel_values") if samples is None else samples,
                ]
            ),
        ],
        dtype=torch.int64,
    )


def _same_batch_group(
    world_size: int, pp: int, batch: int, cp: int, tp: int, timeout: timedelta
) -> tuple[dist.ProcessGroup, list[int]] | None:
    """This rank's gloo group of the ranks that share its batch, and their ranks.

    torchtitan lays ranks out as its dataloading mesh ``(pp, batch, cp, tp)``
    unflattened from the world, so the ranks of one batch index are those with
    that coordinate. Every rank creates every group, as ``new_group`` needs,
    so every rank builds its ``BatchAgreement`` at the same point.
    """
    if pp * cp * tp == 1:
        return None
    groups = [
        [
            ((p * batch + b) * cp + c) * tp + t
            for p in range(pp)
            for c in range(cp)
            for t in range(tp)
        ]
        for b in range(batch)
    ]
    assert sum(map(len, groups)) == world_size, (groups, world_size)
    group, _ = dist.new_subgroups_by_enumeration(
        groups, timeout=timeout, backend="gloo"
    )
    rank = dist.get_rank()
    return group, next(ranks for ranks in groups if rank in ranks)


def _shown(field: str, value: int) -> str:
    return f"{value:016x}" if field in ("grids", "content") else str(value)


class BatchAgreement:
    """Checks, step by step, that this rank's group holds one batch."""

    def __init__(self, parallel_dims: ParallelDims, comm: CommConfig) -> None:
        self._group = _same_batch_group(
            parallel_dims.world_size,
            parallel_dims.pp,
            parallel_dims.dp_replicate * parallel_dims.dp_shard,
            parallel_dims.cp,
            parallel_dims.tp,
            timedelta(seconds=comm.init_timeout_seconds),
        )
        self._train_timeout = timedelta(seconds=comm.train_timeout_seconds)

    def check(
        self, input_dict: dict[str, Any], labels: torch.Tensor, step: str
    ) -> None:
        """Raise on every rank of the group when its ranks' batches differ."""
        if self._group is None:
            return
        group, ranks = self._group
        mine = batch_fingerprint(input_dict, labels)
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        if self._train_timeout is not None:  # every rank is past its start-up
            dist.set_timeout(self._train_timeout, group)
            self._train_timeout = None
        fingerprints = torch.stack(gathered)
        if bool((fingerprints == fingerprints[0]).all()):
            return
        differing = [
            f"{field} "
            + ", ".join(
                f"rank {rank}: {_shown(field, int(value))}"
                for rank, value in zip(ranks, column, strict=True)
            )
            for field, column in zip(FIELDS, fingerprints.T, strict=True)
            if bool((column != column[0]).any())
        ]
        raise RuntimeError(
            f"Ranks {ranks}, which must train on the same batch (one data-parallel "
            f"index: its CP, TP and PP ranks), hold different batches at {step}: "
            + "; ".join(differing)
            + ". A rank's data diverged (a sample skipped or fetched differently on "
            "one rank, a non-deterministic sample processor, a rank restored from "
            "another checkpoint); stopping every rank of the group."
        )
