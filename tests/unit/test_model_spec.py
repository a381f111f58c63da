"""The plug-in model keeps upstream's modules and keys, and checks CP settings early."""

import pytest
import torch
from torchtitan.models.muse_glimmer import model_registry as upstream_model_registry

from torchtitan_ext.muse_glimmer import MuseGlimmerModel, model_registry
from torchtitan_ext.muse_glimmer import config_registry as registry

from ..jobs import train_config


def _built(spec_fn):
    return spec_fn("debugmodel_mm").model.build()


def _randomize(model, seed: int) -> None:
    # Modules leave some states uninitialized until init_weights; fill them all.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))


def test_state_dict_keys_identical_and_strictly_loadable_both_ways():
    upstream = _built(upstream_model_registry)
    plugin = _built(model_registry)
    assert isinstance(plugin, MuseGlimmerModel)
    assert type(upstream) is not type(plugin)
    assert list(plugin.state_dict()) == list(upstream.state_dict())

    _randomize(upstream, seed=0)
    plugin.load_state_dict(upstream.state_dict(), strict=True)
    for name, tensor in upstream.state_dict().items():
        assert torch.equal(plugin.state_dict()[name], tensor), name
    _randomize(plugin, seed=1)
    upstream.load_state_dict(plugin.state_dict(), strict=True)
    for name, tensor in plugin.state_dict().items():
        assert torch.equal(upstream.state_dict()[name], tensor), name


def _update(job):
    job.model_spec.model.update_from_config(config=job)


@pytest.mark.parametrize(
    ("degrees", "seq_len", "message"),
    [
        (
            {"context_parallel_degree": 2},
            384,
            "training.seq_len=384 must be divisible by lcm(2*tp*cp, 128*cp) = "
            "lcm(4, 256) = 256 with tensor_parallel_degree=1 and "
            "context_parallel_degree=2; nearest valid values: 256, 512.",
        ),
        (
            {"context_parallel_degree": 4},
            256,
            "training.seq_len=256 must be divisible by lcm(2*tp*cp, 128*cp) = "
            "lcm(8, 512) = 512 with tensor_parallel_degree=1 and "
            "context_parallel_degree=4; nearest valid values: 512.",
        ),
        (
            {"context_parallel_degree": 2, "tensor_parallel_degree": 2},
            640,
            "training.seq_len=640 must be divisible by lcm(2*tp*cp, 128*cp) = "
            "lcm(8, 256) = 256 with tensor_parallel_degree=2 and "
            "context_parallel_degree=2; nearest valid values: 512, 768.",
        ),
    ],
)
def test_seq_len_rejection_names_the_numbers(degrees, seq_len, message):
    job = registry.muse_glimmer_debugmodel_mm_packed()
    for name, degree in degrees.items():
        setattr(job.parallelism, name, degree)
    job.training.seq_len = seq_len
    with pytest.raises(ValueError) as error:
        _update(job)
    assert str(error.value) == message


@pytest.mark.parametrize("mask_key", [None, "local", "swa_64"])
def test_ptrr_without_a_valid_mask_key_is_rejected(mask_key):
    job = train_config("cp2.toml")
    job.parallelism.context_parallel_ptrr_mask_key = mask_key
    with pytest.raises(ValueError) as error:
        _update(job)
    assert str(error.value) == (
        "context_parallel_load_balancer='ptrr' needs "
        "parallelism.context_parallel_ptrr_mask_key to name one of "
        f"muse_glimmer's attention masks ['global', 'swa_128']; got {mask_key!r}."
    )


def test_varlen_attention_with_cp_is_rejected():
    job = train_config("cp2.toml")
    job.model_spec = model_registry("debugmodel_mm", attn_backend="varlen")
    with pytest.raises(NotImplementedError, match="Varlen attention is not supported"):
        _update(job)


@pytest.mark.parametrize(
    "name", ["cp2.toml", "cp4.toml", "tp2_cp2_sp.toml", "fsdp2_cp2.toml"]
)
def test_valid_cp_jobs_pass_the_start_up_checks(name):
    _update(train_config(name))
