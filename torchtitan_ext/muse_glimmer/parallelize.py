"""Apply TP, AC, compile and FSDP to muse_glimmer, context parallelism included.

Upstream's ``parallelize_muse_glimmer`` refuses CP for the multimodal flavor
before any hook runs, so the plug-in provides its own, in the same order:
TP (``model.parallelize``, driven by the sharding configs), activation
checkpointing, per-block compile, then FSDP of the vision encoder and adapter
before the decoder. Under CP, FSDP's mesh is (dp_shard, cp): the vision
parameters are ``R`` on cp (see ``sharding.py``), so their gradients are summed
over the CP ranks, each of which used only its own tokens' feature rows.
"""

from torchtitan.config import (
    TORCH_DTYPE_MAP,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import (
    apply_fsdp_to_decoder,
    apply_fsdp_to_vision_encoder,
)
from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, validate_config
from torchtitan.tools.logging import logger

from .model import MuseGlimmerModel

__all__ = ["parallelize_muse_glimmer"]


def parallelize_muse_glimmer(
    model: MuseGlimmerModel,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
    skip_dp: bool = False,
):
    if parallelism.spmd_backend != "spmd_types":
        raise NotImplementedError(
            "muse_glimmer only supports spmd_backend='spmd_types'; "
            f"got '{parallelism.spmd_backend}'."
        )
    vision_modules = [
        module
        for module in (model.vision_encoder, model.vision_adapter)
        if module is not None
    ]
    validate_config(parallel_dims, model)
    model.parallelize(parallel_dims)

    if ac_config is not None:
        ac_policy = ac_config.build(dump_folder=dump_folder)
        ac_policy.apply(model)
        if model.vision_encoder is not None:
            # The adapter is a two-layer MLP without blocks: left unwrapped.
            ac_policy.apply(model.vision_encoder)

    if compile_config.enable and "model" in compile_config.components:
        for module in (model, *vision_modules):
            apply_compile(
                module, compile_config=compile_config, parallel_dims=parallel_dims
            )

    if skip_dp:
        return model

    dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    for module in vision_modules:
        apply_fsdp_to_vision_encoder(
            module,
            dp_mesh,
            param_dtype,
            reduce_dtype,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            dp_mesh_dims=dp_mesh_dims,
        )
    apply_fsdp_to_decoder(
        model,
        dp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        dp_mesh_dims=dp_mesh_dims,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    logger.info("Applied fully_shard to the model")
    return model
