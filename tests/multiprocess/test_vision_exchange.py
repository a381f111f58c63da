"""The vision-row exchange of sharded vision, on real gloo ranks, against one process.

Each rank holds the rows of its own images; its tokens gather rows of any
rank's images from the exchanged bank. The bank must be the single-process
concatenation bitwise, and each rank's row gradient the full gradient of its
rows over every rank's tokens: a forward gather whose backward only slices
the local rows would drop what other ranks' tokens contributed.
"""

import spmd_types as spmd
import torch
import torch.distributed as dist

from torchtitan_ext.muse_glimmer import exchange_vision_rows
from torchtitan_ext.tools.local_ranks import run_on_ranks

DIM = 8


def _problem(rows_per_rank: list[int]):
    """Every rank's rows, every rank's gathered indices and output gradients."""
    generator = torch.Generator().manual_seed(0)
    total = sum(rows_per_rank)
    rows = [torch.randn(n, DIM, generator=generator) for n in rows_per_rank]
    # Each rank's tokens read 6 rows, some twice, the first from another rank.
    first_row = [sum(rows_per_rank[:r]) for r in range(len(rows_per_rank))]
    indices = []
    for rank in range(len(rows_per_rank)):
        index = torch.randint(0, total, (6,), generator=generator)
        other = next(
            r for r in range(len(rows_per_rank)) if r != rank and rows_per_rank[r]
        )
        index[0] = first_row[other]
        indices.append(index)
    grads = [torch.randn(6, DIM, generator=generator) for _ in rows_per_rank]
    return rows, indices, grads


def _reference(rows_per_rank: list[int]):
    rows, indices, grads = _problem(rows_per_rank)
    leaves = [r.clone().requires_grad_() for r in rows]
    bank_TD = torch.cat(leaves)
    loss = sum((bank_TD[i] * g).sum() for i, g in zip(indices, grads, strict=True))
    loss.backward()
    return bank_TD.detach(), [leaf.grad for leaf in leaves]


def _exchange_on_rank(rows_per_rank: list[int], slice_backward: bool = False):
    rank = dist.get_rank()
    if slice_backward:
        # The planted bug: the gather's backward keeps only this rank's slice.
        gather = spmd.all_gather
        spmd.all_gather = lambda *a, **k: gather(*a, **{**k, "dst": spmd.I})
    rows, indices, grads = _problem(rows_per_rank)
    local_RD = rows[rank].clone().requires_grad_()
    bank_TD = exchange_vision_rows(local_RD, rows_per_rank, dist.group.WORLD)
    (bank_TD[indices[rank]] * grads[rank]).sum().backward()
    return bank_TD.detach(), local_RD.grad


def test_exchange_matches_one_process():
    rows_per_rank = [4, 0, 7, 1]  # uneven shares; a rank with none (a blank's)
    bank_TD, grads = _reference(rows_per_rank)
    results = run_on_ranks(
        _exchange_on_rank, len(rows_per_rank), rows_per_rank, timeout_s=120
    )
    for rank, (got_bank_TD, got_grad_RD) in enumerate(results):
        assert torch.equal(got_bank_TD, bank_TD), rank
        assert got_grad_RD.shape == grads[rank].shape
        torch.testing.assert_close(got_grad_RD, grads[rank], rtol=0, atol=1e-6)


def test_a_backward_that_keeps_the_local_slice_is_caught():
    rows_per_rank = [3, 5]
    bank_TD, grads = _reference(rows_per_rank)
    results = run_on_ranks(
        _exchange_on_rank, 2, rows_per_rank, slice_backward=True, timeout_s=120
    )
    for rank, (got_bank_TD, got_grad_RD) in enumerate(results):
        assert torch.equal(got_bank_TD, bank_TD)  # the forward is right
        assert not torch.allclose(got_grad_RD, grads[rank], atol=1e-6), rank
