"""muse_glimmer with vision injection by bank index, so it runs under CP."""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.distributed.spmd_types import spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.multimodal import multimodal_context
from torchtitan.models.muse_glimmer.model import MuseGlimmerModel as _UpstreamModel

from .config_checks import check_context_parallel, check_tensor_parallel_heads
from .sharding import (
    BANK_TYPE,
    CP,
    DP,
    SHARDED_VISION_INPUT_TYPE,
    TOKEN_TYPE,
    VISION_INPUT_TYPE,
    set_cp_vision_sharding_config,
)
from .vision_bank import CpVisionShare

__all__ = ["MuseGlimmerModel", "exchange_vision_rows", "gather_vision_rows"]


@spmd.register_local_autograd_function
class _WriteVisionRows(torch.autograd.Function):
    """Write every bank row into ``h`` in place: O(bank rows x dim), no host sync.

    Each bank row has one target, so the write's size is the bank's shape: the
    flat position of its placeholder on this rank or, for a row no token here
    gathers (held by another CP rank, a blank image's), the last position, which
    is restored after the writes, so the result never depends on their order.
    Gradients are upstream's slice writes': zero for ``h`` at placeholders (one
    copy of the gradient, as for one span), the placeholder's gradient for its
    bank row, and zero for the rows not held here.
    """

    @staticmethod
    def forward(ctx, h_BLD, vision_bank_TD, vision_bank_indices_BL):
        T, D = vision_bank_TD.shape
        h_ND = h_BLD.view(-1, D)
        indices_N = vision_bank_indices_BL.reshape(-1)
        N = indices_N.shape[0]
        device = indices_N.device
        # remainder() sends every text token's -1 to the spare slot T, which is dropped.
        position_T1 = torch.full((T + 1,), N, dtype=torch.long, device=device)
        position_T1.scatter_(
            0, indices_N.remainder(T + 1), torch.arange(N, device=device)
        )
        target_T = position_T1[:T].clamp(max=N - 1)
        last_is_vision = indices_N[-1] >= 0
        # A text token's -1 reads the bank's last row, which where() discards.
        last_row_D = vision_bank_TD[indices_N[-1:].clamp(min=0)][0]  # no .item()
        last_D = torch.where(last_is_vision, last_row_D, h_ND[-1])
        h_ND.index_copy_(0, target_T, vision_bank_TD)
        h_ND[-1] = last_D
        ctx.mark_dirty(h_BLD)
        ctx.save_for_backward(target_T, position_T1[:T] == N, last_is_vision)
        return h_BLD

    @staticmethod
    def backward(ctx, grad_BLD):
        target_T, elsewhere_T, last_is_vision = ctx.saved_tensors
        D = grad_BLD.shape[-1]
        grad_ND = grad_BLD.reshape(-1, D)
        grad_h_BLD = grad_bank_TD = None
        if ctx.needs_input_grad[1]:
            grad_bank_TD = grad_ND.index_select(0, target_T)
            grad_bank_TD.masked_fill_(elsewhere_T.unsqueeze(-1), 0)
        if ctx.needs_input_grad[0]:
            grad_h_ND = grad_ND.index_fill(0, target_T, 0)
            # The rows held elsewhere cleared the last position too: restore it.
            zero = grad_ND.new_zeros(())
            torch.where(last_is_vision, zero, grad_ND[-1], out=grad_h_ND[-1])
            grad_h_BLD = grad_h_ND.view_as(grad_BLD)
        return grad_h_BLD, grad_bank_TD, None


def _gather_vision_rows_local(
    h_BLD: torch.Tensor,
    vision_bank_TD: torch.Tensor,
    vision_bank_indices_BL: torch.Tensor,
) -> torch.Tensor:
    return _WriteVisionRows.apply(
        h_BLD, vision_bank_TD.to(h_BLD.dtype), vision_bank_indices_BL
    )


_gather_vision_rows_typed = spmd.local_map(
    in_types=(TOKEN_TYPE, BANK_TYPE, TOKEN_TYPE), out_types=TOKEN_TYPE
)(_gather_vision_rows_local)


def gather_vision_rows(
    h_BLD: torch.Tensor,
    vision_bank_TD: torch.Tensor,
    vision_bank_indices_BL: torch.Tensor,
) -> torch.Tensor:
    """Write the vision-bank rows of image placeholders into ``h`` and return it.

    In place, as upstream's ``_inject_vision`` (so ``h`` is not a leaf that
    requires grad), but by index: no host sync, no loop over spans, writes
    proportional to the bank, on whatever (CP-permuted) slice of the sequence
    this rank holds. The bank is replicated across CP and each rank's gradient
    covers only the rows it wrote: a partial sum on cp that FSDP's reduction
    over (dp_shard, cp) completes.
    """
    if get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
        return _gather_vision_rows_typed(h_BLD, vision_bank_TD, vision_bank_indices_BL)
    return _gather_vision_rows_local(h_BLD, vision_bank_TD, vision_bank_indices_BL)


def exchange_vision_rows(
    local_rows_RD: torch.Tensor,
    rows_per_rank: Sequence[int],
    cp_group: dist.ProcessGroup | str = CP,
) -> torch.Tensor:
    """The whole vision bank from each CP rank's rows, in rank order.

    Each rank encoded a contiguous range of the images, so the ranks' rows,
    concatenated in rank order, are the replicated bank. Forward: an
    all-gather of equal blocks (``rows_per_rank`` padded to the largest, host
    ints: no sync); backward: its reduce-scatter, a sum, so a rank receives
    the gradient of its rows from every rank's tokens, not only its own
    (the gradient that a forward gather with a local-slice backward drops).
    The reduction runs in float32 whatever the rows' dtype, as FSDP's does.
    ``cp_group`` is a process group or the cp axis of the ambient spmd mesh.
    """
    block = max(rows_per_rank)
    padded_RD = F.pad(local_rows_RD, (0, 0, 0, block - local_rows_RD.shape[0]))
    gathered_CRD = spmd.all_gather(
        padded_RD,
        cp_group,
        src=spmd.V,
        dst=spmd.R,
        backward_options={"op_dtype": torch.float32},
    )
    return torch.cat(
        [gathered_CRD[rank, :rows] for rank, rows in enumerate(rows_per_rank)]
    )


def cp_local_vision_context() -> contextlib.AbstractContextManager[None]:
    """Treat dp and cp as local axes while a CP rank encodes its own images.

    Upstream's ``multimodal_context`` makes dp local, since each DP rank encodes
    its own images. With sharded vision each CP rank does too, so its vision
    activations are ``V`` on cp with no global layout to name: cp must be a
    local axis as well, until the exchange makes the bank ``R`` on cp.
    """
    if get_spmd_backend() != "spmd_types":
        return contextlib.nullcontext()
    local_axes = tuple(axis for axis in (DP, CP) if spmd_mesh_size(axis) > 1)
    return spmd.set_current_mesh(local_axes=local_axes)


class MuseGlimmerModel(_UpstreamModel):
    """torchtitan's muse_glimmer, injecting vision features by ``vision_bank_indices``.

    Same modules and state-dict keys as upstream; only the injection differs.
    With sharded vision each CP rank encodes its share of the images (the
    Trainer slices them) and the projected rows are exchanged before the gather.
    """

    # What ``forward`` hands to the vision methods for the duration of a call.
    _vision_bank_indices_BL: torch.Tensor | None = None
    _cp_vision_share: CpVisionShare | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(_UpstreamModel.Config):
        context_parallel_vision: str = "replicated"
        """Set from ``parallelism.context_parallel_vision`` by the job."""

        def update_from_config(self, *, config, **kwargs) -> None:
            self.context_parallel_vision = getattr(
                config.parallelism, "context_parallel_vision", "replicated"
            )
            if self.vision_encoder is not None:
                # Before upstream's update, which lowers max_seq_len to seq_len.
                check_context_parallel(self, config)
                check_tensor_parallel_heads(
                    self, config.parallelism.tensor_parallel_degree
                )
            _UpstreamModel.Config.update_from_config(self, config=config, **kwargs)
            if self.vision_encoder is not None:
                set_cp_vision_sharding_config(
                    self, sharded=self.context_parallel_vision == "sharded"
                )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        *,
        vision_bank_indices: torch.Tensor | None = None,
        cp_vision_share: CpVisionShare | None = None,
        **kwargs,
    ):
        if get_spmd_backend() == "spmd_types":
            sharded = self.config.context_parallel_vision == "sharded"
            input_type = SHARDED_VISION_INPUT_TYPE if sharded else VISION_INPUT_TYPE
            region = cp_local_vision_context() if sharded else multimodal_context()
            with region:
                for name in ("pixel_values", "grid_thw"):
                    if kwargs.get(name) is not None:
                        spmd.assert_type(kwargs[name], input_type)
        # _inject_vision's signature is upstream's; these reach it from here.
        self._vision_bank_indices_BL = vision_bank_indices
        self._cp_vision_share = cp_vision_share
        try:
            return super().forward(tokens, positions, attention_masks, **kwargs)
        finally:
            self._vision_bank_indices_BL = None
            self._cp_vision_share = None

    def _get_vision_features(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """Upstream's encoder and adapter; on this CP rank's share when sharded."""
        if self._cp_vision_share is None:
            return super()._get_vision_features(pixel_values, grid_thw)
        with cp_local_vision_context():
            return super()._get_vision_features(pixel_values, grid_thw)

    def _inject_vision(
        self,
        h: torch.Tensor,
        vision_features: torch.Tensor,
        vision_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Project + norm the bank; gather this rank's rows.

        With sharded vision the features are this CP rank's share: they are
        projected and normed here, then exchanged. Exchanging after the norm
        rather than after the adapter sends rows of the decoder's width, not
        the adapter's, but leaves the bank the only vision tensor every CP rank
        holds whole: projection and norm activations shrink with CP too.
        """
        vision_bank_indices_BL = self._vision_bank_indices_BL
        if vision_bank_indices_BL is None:
            raise ValueError(
                "pixel_values were given without vision_bank_indices; build them "
                "with torchtitan_ext.muse_glimmer.build_vision_bank_indices (the "
                "plug-in's Trainer does) before context-parallel sharding."
            )
        share = self._cp_vision_share
        if share is None:
            vision_bank_TD = self._project_vision(vision_features)
        else:
            with cp_local_vision_context():
                # A rank with no images of its own encoded a blank one: none of it.
                local_rows = share.rows_per_rank[share.cp_rank]
                vision_bank_TD = exchange_vision_rows(
                    self._project_vision(vision_features)[:local_rows],
                    share.rows_per_rank,
                )
        return gather_vision_rows(h, vision_bank_TD, vision_bank_indices_BL)

    def _project_vision(self, vision_features: torch.Tensor) -> torch.Tensor:
        assert self.vision_projection is not None
        assert self.perception_emb_norm is not None
        return self.perception_emb_norm(
            self.vision_projection(vision_features)
        ).squeeze(0)
