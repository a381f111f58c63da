"""The training entry point with one bug planted: the parity checks must see it.

``TRAIN_FILE=tests.planted_bugs TORCHTITAN_EXT_PLANTED_BUG=<name> ./run_train.sh``
monkeypatches the plug-in in every rank's process (no file is edited), then
trains as ``torchtitan_ext.train`` does. Each bug is one a CP change could
plausibly ship; ``PLANTED_BUGS`` names them.
"""

import os

from torchtitan_ext import cpu_backend

__all__ = ["PLANTED_BUGS", "main", "patch_bank_indices"]

# headtail with cp=2 gives rank 0 the chunks 0 and 3 of four, rank 1 chunks 1 and 2.
_HEADTAIL_CP2_RANK_BOUNDARIES = (1, 3)


def patch_bank_indices(module, shift) -> None:
    """``module.build_vision_bank_indices``, its result then changed in place by
    ``shift(indices_BL, tokens_BL, grid_thw_N3, spatial_merge_size)``."""
    build = module.build_vision_bank_indices

    def planted(tokens_BL, grid_thw_N3, *, image_id, spatial_merge_size):
        indices_BL = build(
            tokens_BL,
            grid_thw_N3,
            image_id=image_id,
            spatial_merge_size=spatial_merge_size,
        ).clone()
        shift(indices_BL, tokens_BL, grid_thw_N3, spatial_merge_size)
        return indices_BL

    module.build_vision_bank_indices = planted


def _rows_off_by_one_at_a_boundary() -> None:
    """An image's rows off by one past a CP shard boundary its span crosses.

    Under headtail at cp=2 the placeholders after the boundary (held by the
    other rank) read the image's next row, wrapping within the image: the
    offset bug a rank that starts inside an image would make. The packed
    debug data's step-2 batch has such an image; step 1's has none.
    """
    from torchtitan_ext.muse_glimmer import trainer

    def off_by_one(indices_BL, tokens_BL, grid_thw_N3, merge) -> None:
        length = tokens_BL.shape[1]
        for row_L in indices_BL:
            for chunk in _HEADTAIL_CP2_RANK_BOUNDARIES:
                boundary = chunk * length // 4
                if row_L[boundary - 1] < 0 or row_L[boundary] < 0:
                    continue
                start, end = boundary - 1, boundary
                while start > 0 and row_L[start - 1] >= 0:
                    start -= 1
                while end < length and row_L[end] >= 0:
                    end += 1
                first, rows = row_L[start], end - start
                row_L[boundary:end] = first + (row_L[boundary:end] - first + 1) % rows

    patch_bank_indices(trainer, off_by_one)


def _shard_bank_indices_contiguously() -> None:
    """Bank indices cut into contiguous CP shards while the tokens are balanced."""
    from torchtitan_ext.muse_glimmer import trainer

    post_process = trainer.MuseGlimmerTrainer.post_dataloading_process

    def contiguous(self, input_dict, labels):
        inputs, labels_out, extra = post_process(self, input_dict, labels)
        if self.parallel_dims.cp_enabled and input_dict.get("pixel_values") is not None:
            geometry = trainer.VisionGeometry.of(self.model_config)
            indices_BL = trainer.build_vision_bank_indices(
                input_dict["input"],
                input_dict["grid_thw"],
                image_id=input_dict["special_tokens"]["image_id"],
                spatial_merge_size=geometry.spatial_merge_size,
            )
            cp_mesh = self.parallel_dims.get_mesh("cp")
            shard_BL = indices_BL.chunk(cp_mesh.size(), dim=1)[cp_mesh.get_local_rank()]
            extra["vision_bank_indices"] = shard_BL.contiguous().to(inputs.device)
        return inputs, labels_out, extra

    trainer.MuseGlimmerTrainer.post_dataloading_process = contiguous


def _all_gather_vision_kv_over_cp() -> None:
    """The vision attention keeps the decoder's layout: k/v all-gathered over cp."""
    from torchtitan_ext.muse_glimmer import sharding

    def decoder_layout(decoder_style, activation_type=None):
        return decoder_style

    sharding._vision_inner_attention_sharding = decoder_layout


def _average_bank_gradient_over_cp() -> None:
    """The bank's gradient divided by the CP degree, as if each CP rank's were
    a replica's to average: each covers only its own tokens' rows, so the sum
    FSDP takes over (dp_shard, cp) is already the whole gradient."""
    import torch.distributed as dist

    from torchtitan_ext.muse_glimmer import model

    gather = model.gather_vision_rows

    def averaged(h_BLD, vision_bank_TD, vision_bank_indices_BL):
        if vision_bank_TD.requires_grad:
            cp = dist.get_world_size()  # the CP2 job: one CP group of all ranks
            vision_bank_TD.register_hook(lambda grad: grad / cp)
        return gather(h_BLD, vision_bank_TD, vision_bank_indices_BL)

    model.gather_vision_rows = averaged


def _keep_local_rows_in_exchange_backward() -> None:
    """Sharded vision's exchange: an all-gather whose backward keeps the local slice.

    Megatron-Bridge shipped this (PR 4784): the gradient that other CP ranks'
    tokens send to a rank's image rows is dropped instead of reduce-scattered.
    """
    import spmd_types as spmd

    from torchtitan_ext.muse_glimmer import model

    exchange = model.exchange_vision_rows
    all_gather = spmd.all_gather

    def gather_with_local_backward(*args, **kwargs):
        return all_gather(*args, **{**kwargs, "dst": spmd.I})

    def local_backward_exchange(*args, **kwargs):
        spmd.all_gather = gather_with_local_backward
        try:
            return exchange(*args, **kwargs)
        finally:
            spmd.all_gather = all_gather

    model.exchange_vision_rows = local_backward_exchange


PLANTED_BUGS = {
    "image_rows_off_by_one_at_a_shard_boundary": _rows_off_by_one_at_a_boundary,
    "bank_indices_sharded_contiguously": _shard_bank_indices_contiguously,
    "vision_kv_all_gathered_over_cp": _all_gather_vision_kv_over_cp,
    "bank_gradient_averaged_over_cp": _average_bank_gradient_over_cp,
    "exchange_backward_keeps_local_rows": _keep_local_rows_in_exchange_backward,
}


def main() -> None:
    cpu_backend.apply()
    name = os.environ.get("TORCHTITAN_EXT_PLANTED_BUG", "")
    if name not in PLANTED_BUGS:
        raise SystemExit(
            f"TORCHTITAN_EXT_PLANTED_BUG={name!r}; valid: {sorted(PLANTED_BUGS)}"
        )
    PLANTED_BUGS[name]()
    from torchtitan_ext import train

    train.main()


if __name__ == "__main__":
    main()
