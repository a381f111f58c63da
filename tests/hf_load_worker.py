"""One job loaded from a Hugging Face checkpoint on torchrun ranks: state, logits.

``python -m torch.distributed.run --nproc_per_node N -m tests.hf_load_worker
--hf DIR --out FILE [--dcp DIR] [--batches FILE] [--export] -- <trainer flags>``
builds the plug-in's Trainer as ``torchtitan_ext.train`` does, loads ``--hf``
with torchtitan's ``--checkpoint.initial_load_in_hf`` (what ``train()`` does
first), then, as asked:

- ``--dcp``: every rank's shard of every parameter equal, bitwise, to the
  same tensor loaded from a DCP checkpoint of the same weights;
- ``--batches``: the model's logits on each batch (forward only), the CP
  shards put back in sequence order with the positions CP sharded along,
  also with one image's rows off by one (``hf_reference``'s planted bug);
- ``--export``: one training step, then ``--checkpoint.last_save_in_hf``
  writes the model, and rank 0 keeps the full trained state beside it.

Rank 0 writes the results to ``--out`` (``torch.save``).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

__all__ = ["main"]


def _build_trainer(args, flags: list[str]):
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from torchtitan_ext.config_file import merge_args

    init_logger()
    load = [
        "--checkpoint.enable",
        f"--checkpoint.folder={args.out.parent / 'checkpoint'}",
        f"--checkpoint.initial_load_path={args.hf}",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype=float32",
        "--training.mixed_precision_param=float32",
        "--debug.deterministic",
        f"--dump_folder={args.out.parent}",
    ]
    config = ConfigManager().parse_args(merge_args([*flags, *load]))
    trainer = config.build()
    trainer.checkpointer.load(step=-1)
    return trainer


def _state(trainer) -> dict[str, torch.Tensor]:
    return {k: v for part in trainer.model_parts for k, v in part.state_dict().items()}


def _unequal_to_dcp(trainer, dcp_dir: Path) -> list[str]:
    """Keys whose local shard differs from the same tensor loaded from ``dcp_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    state = _state(trainer)
    twin = {key: torch.full_like(value, float("nan")) for key, value in state.items()}
    dcp.load(twin, checkpoint_id=str(dcp_dir))

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    return [k for k in state if not torch.equal(local(state[k]), local(twin[k]))]


@torch.no_grad()
def _logits(trainer, input_dict, labels_BL) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits and the sequence position of each (CP-sharded alike)."""
    B, L = labels_BL.shape
    positions_BL = torch.arange(L).expand(B, L).contiguous()
    batch = next(trainer.batch_generator(iter([(input_dict, positions_BL)])))
    inputs, positions_BL, extra = trainer.post_dataloading_process(*batch)
    model = trainer.model_parts[0]
    with trainer.train_context():
        output = model(inputs, **extra)
    # Under torchtitan's ChunkedLossWrapper the loss applies the head.
    return (model.lm_head(output) if model._skip_lm_head else output), positions_BL


def _gathered_logits(trainer, batches) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    local = {
        name: _logits(trainer, b["input_dict"], b["labels"]) for name, b in batches
    }
    everyone = [None] * dist.get_world_size()
    dist.gather_object(local, everyone if dist.get_rank() == 0 else None)
    if dist.get_rank() != 0:
        return {}
    logits = {}
    for name, b in batches:
        full_BLV = None
        for rank_logits in everyone:
            logits_BlV, positions_Bl = rank_logits[name]
            if full_BLV is None:
                full_BLV = logits_BlV.new_full(
                    (*b["labels"].shape, logits_BlV.shape[-1]), float("nan")
                )
            full_BLV.scatter_(
                1, positions_Bl[..., None].expand_as(logits_BlV), logits_BlV
            )
        assert not full_BLV.isnan().any(), f"{name}: a position no rank computed"
        logits[name] = full_BLV
    return logits


def _export(trainer) -> dict[str, torch.Tensor]:
    """One training step, the HF export of its model; the full state on rank 0."""
    from torch.distributed.tensor import DTensor

    trainer.step = 1
    trainer.train_step(trainer.batch_generator(trainer.dataloader))
    trainer.checkpointer.save(curr_step=1, last_step=True)
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        for key, value in _state(trainer).items()
    }


def main() -> None:
    from torchtitan_ext import cpu_backend

    cpu_backend.apply()
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="tests.hf_load_worker")
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dcp", type=Path)
    parser.add_argument("--batches", type=Path)
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args(argv[:split])

    import torch.distributed as dist

    from torchtitan_ext.muse_glimmer import trainer as plugin_trainer

    from .hf_reference import plant_rows_off_by_one

    trainer = _build_trainer(args, argv[split + 1 :])
    results = {}
    if args.dcp is not None:
        unequal = [None] * dist.get_world_size()
        dist.all_gather_object(unequal, _unequal_to_dcp(trainer, args.dcp))
        results["unequal_to_dcp"] = sorted({k for keys in unequal for k in keys})
    if args.batches is not None:
        batches = torch.load(args.batches, weights_only=False)
        results["logits"] = _gathered_logits(trainer, batches)
        build = plugin_trainer.build_vision_bank_indices
        plant_rows_off_by_one(plugin_trainer)
        results["logits_rows_off_by_one"] = _gathered_logits(trainer, batches)
        plugin_trainer.build_vision_bank_indices = build
    if args.export:
        results["trained_state"] = _export(trainer)
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown has aborted after results (README)


if __name__ == "__main__":
    main()
