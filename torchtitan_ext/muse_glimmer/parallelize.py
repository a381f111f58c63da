"""Apply TP, AC, compile and FSDP to muse_glimmer, context parallelism included.

This is torchtitan 0.3.0's ``parallelize_muse_glimmer`` minus its refusal of
CP for the vision encoder, which it raises before any hook could run, so the
function is replaced whole; ``tests/unit/test_upstream_guards.py`` fails when
the installed torchtitan's function differs from this one by anything else.
Under CP, FSDP's mesh is (dp_shard, cp): the vision parameters are ``R`` on cp
(``sharding.py``), so their gradients are summed over the CP ranks, each of
which used only its own tokens' feature rows.

``apply_compile`` here is torchtitan's, except that a module without a
``layers`` block stack (the vision adapter, a two-layer MLP) is left eager:
0.3.0's function raises ``AttributeError`` on it, so ``--compile.enable``
failed for every multimodal muse_glimmer job, upstream's included. torchtitan
PR #4806 (merged after 0.3.0) stops compiling the adapter; this does the same
without touching the function body the guard test compares.
"""

from torchtitan.config import (
    TORCH_DTYPE_MAP,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile as _upstream_apply_compile
from torchtitan.distributed.fsdp import (
    apply_fsdp_to_decoder,
    apply_fsdp_to_vision_encoder,
)
from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, validate_config
from torchtitan.tools.logging import logger

from .model import MuseGlimmerModel

__all__ = ["apply_compile", "parallelize_muse_glimmer"]


def apply_compile(model, *, compile_config: CompileConfig, parallel_dims) -> None:
    """torchtitan's per-block compile; a module without ``layers`` stays eager."""
    if not hasattr(model, "layers"):
        logger.info(f"{type(model).__name__} has no block stack: left uncompiled")
        return
    _upstream_apply_compile(
        model, compile_config=compile_config, parallel_dims=parallel_dims
    )


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
            "Muse Glimmer only supports spmd_backend='spmd_types'; "
            f"got '{parallelism.spmd_backend}'."
        )

    assert training.seq_len % parallel_dims.seq_len_divisor == 0, f"""
        Sequence length {training.seq_len} must be divisible by the product of TP degree
        ({parallel_dims.tp}) and 2 * CP degree ({parallel_dims.cp}).
        """

    # The encoder + adapter are submodules: TP is applied by ``model.parallelize``
    # (driven by the sharding configs), AC/compile/FSDP explicitly below.
    has_vision = model.vision_encoder is not None
    if has_vision:
        assert model.vision_adapter is not None
        if parallel_dims.tp_enabled:
            vision_num_heads = model.vision_encoder.num_heads
            assert vision_num_heads % parallel_dims.tp == 0, (
                f"vision num_heads ({vision_num_heads}) must be "
                f"divisible by TP degree ({parallel_dims.tp})"
            )

    validate_config(parallel_dims, model)
    model.parallelize(parallel_dims)
    model_compile_enabled = (
        compile_config.enable and "model" in compile_config.components
    )

    if ac_config is not None:
        ac_policy = ac_config.build(dump_folder=dump_folder)
        ac_policy.apply(model)
        if has_vision:
            # The adapter is a two-layer MLP without blocks: left unwrapped.
            ac_policy.apply(model.vision_encoder)

    # Per-block compile after AC wrapping and before FSDP.
    if model_compile_enabled:
        apply_compile(
            model,
            compile_config=compile_config,
            parallel_dims=parallel_dims,
        )
        if has_vision:
            apply_compile(
                model.vision_encoder,
                compile_config=compile_config,
                parallel_dims=parallel_dims,
            )
            apply_compile(
                model.vision_adapter,
                compile_config=compile_config,
                parallel_dims=parallel_dims,
            )

    if skip_dp:
        return model

    dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)

    # The vision encoder and adapter are one FSDP unit each, before the decoder.
    if has_vision:
        param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
        reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
        for module in (model.vision_encoder, model.vision_adapter):
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
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        dp_mesh_dims=dp_mesh_dims,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )

    logger.info("Applied fully_shard to the model")

    if training.enable_cpu_offload:
        logger.info("Applied CPU Offloading to the model")

    return model
