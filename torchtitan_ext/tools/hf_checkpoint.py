"""A Hugging Face muse_glimmer checkpoint of the plug-in's debug multimodal model.

``python -m torchtitan_ext.tools.hf_checkpoint --out DIR [--seed N | --from-dcp PATH]``
(README: "Hugging Face weights and the transformers reference")."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchtitan_ext.embedded_data import SPECIAL_TOKENS

__all__ = ["hf_config", "seeded_state_dict", "write_hf_checkpoint"]

FLAVOR = "debugmodel_mm"


def hf_config(model_config) -> dict:
    """transformers' ``MuseGlimmerConfig`` of ``model_config``, embedded token ids."""
    attention = [layer.attention for layer in model_config.layers]
    windows = {a.window_size for a in attention if a.window_size is not None}
    assert len(windows) == 1, f"one sliding window for HF's config, got {windows}"
    layer0, a0 = model_config.layers[0], attention[0]
    encoder = model_config.vision_encoder
    layers = encoder.num_layers
    text_config = {
        "model_type": "muse_glimmer_text",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": layer0.feed_forward.w1.out_features,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": a0.n_heads,
        "num_key_value_heads": a0.n_kv_heads,
        "head_dim": a0.head_dim,
        "max_position_embeddings": a0.rope.max_seq_len,
        "rms_norm_eps": layer0.attention_norm.eps,
        "post_norm_eps": layer0.post_attention_norm.eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": a0.rope.theta},
        "sliding_window": windows.pop(),
        "layer_types": [
            "full_attention" if a.window_size is None else "sliding_attention"
            for a in attention
        ],
        # 0 is HF's NoPE.
        "layer_rope_theta": [a.rope.theta if a.use_rope else 0.0 for a in attention],
        # torchtitan scales the normed query by scale_query_by, as HF by this.
        "qk_scale_factor": a0.scale_query_by,
        "output_multiplier": model_config.lm_head.output_multiplier,
        "final_logit_softcapping": model_config.lm_head.output_soft_cap_temp,
        "tie_word_embeddings": False,
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "bos_token_id": SPECIAL_TOKENS.index("<|begin_of_text|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|end_of_text|>"),
    }
    vision_config = {
        "model_type": "muse_glimmer_vision",
        "hidden_size": encoder.latent_dim,
        "intermediate_size": encoder.block.mlp.fc1.out_features,
        "num_hidden_layers": layers,
        "num_attention_heads": encoder.num_heads,
        "patch_size": encoder.patch_size,
        "patch_temporal": encoder.patch_temporal,
        "merge_size": encoder.downsample_factor,
        "pos_emb_height": encoder.pos_emb_grid_h,
        "pos_emb_width": encoder.pos_emb_grid_w,
        "max_position_embeddings": encoder.pos_emb_grid_h * encoder.pos_emb_grid_w,
        "hidden_act": "gelu",
        "layer_norm_eps": encoder.ln_pre.eps,
        # Upstream's _layer_uses_global_attention: the last layer and every
        # sparse_attention_factor-th; HF's default (every 4th) differs.
        "layer_types": [
            "full_attention"
            if i == layers - 1 or (i + 1) % encoder.sparse_attention_factor == 0
            else "window_attention"
            for i in range(layers)
        ],
        "rope_parameters": {
            "rope_type": "axial",
            "rope_theta": encoder.rope_freq.rope_theta,
        },
    }
    return {
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "model_type": "muse_glimmer",
        "dtype": "float32",
        "text_config": text_config,
        "vision_config": vision_config,
        "out_hidden_size": encoder.output_dim,
        "projector_hidden_size": model_config.vision_adapter.c_fc.out_features,
        "projector_hidden_act": "gelu",
        "image_token_id": SPECIAL_TOKENS.index("<|image_pad|>"),
        "video_token_id": SPECIAL_TOKENS.index("<|video_pad|>"),
    }


def _model_spec():
    from torchtitan_ext.muse_glimmer import model_registry

    return model_registry(FLAVOR)


def seeded_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """torchtitan's seeded init, constant tensors (norm gains and biases, the final
    norm's at 0) drawn from N(0.5, 0.25): every logit and gradient is non-trivial."""
    torch.manual_seed(seed)
    model = _model_spec().model.build()
    model.init_weights()
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.min() == tensor.max():
            drawn = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensor = 0.5 + 0.25 * drawn
        state[name] = tensor.detach().clone()
    return state


def write_hf_checkpoint(out: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """``out/model.safetensors`` and ``out/config.json`` of a torchtitan state."""
    spec = _model_spec()  # its adapter converts initial_load_in_hf's checkpoints
    hf_state = spec.state_dict_adapter(spec.model, None).to_hf(state_dict)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.contiguous() for key, value in hf_state.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(spec.model), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ext.tools.hf_checkpoint",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--out", type=Path, required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--seed", type=int, default=0, help="seeded, perturbed init")
    source.add_argument("--from-dcp", type=Path, help="a torchtitan DCP checkpoint")
    args = parser.parse_args(argv)
    if args.from_dcp is None:
        print(write_hf_checkpoint(args.out, seeded_state_dict(args.seed)))
        return
    from torchtitan_ext.tools.parity import checkpoint_tensors

    print(write_hf_checkpoint(args.out, checkpoint_tensors(args.from_dcp)))


if __name__ == "__main__":
    main()
