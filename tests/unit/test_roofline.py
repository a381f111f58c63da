"""The planner's step time and its decision verb.

The roofline's FLOPs of one 30B_mm decoder layer and one vision block are
counted here by hand from the released model's shapes. The verb's choice is
checked where the answer follows from how it is built: with memory to spare
the fastest candidate on paper is chosen and nothing else is planned; with the
memory set just below that candidate's planned peak, the choice is the first
in order of time whose planned peak fits.
"""

import dataclasses

from torchtitan_ext.muse_glimmer import model_registry
from torchtitan_ext.tools.estimate.fit import choose
from torchtitan_ext.tools.estimate.roofline import Hardware, forward_flops

from ..jobs import TRAIN_CONFIGS

S = 8192


def _one_layer(layer: int):
    """30B_mm with decoder layer ``layer`` alone and one vision block."""
    model = model_registry("30B_mm").model
    encoder = dataclasses.replace(model.vision_encoder, num_layers=1)
    return dataclasses.replace(
        model, layers=[model.layers[layer]], vision_encoder=encoder
    )


def test_one_30b_decoder_layer_by_hand():
    sliding = 2048 * 2049 // 2 + (S - 2048) * 2048  # keys: causal, within 2048
    for layer, keys in ((0, sliding), (3, S * (S + 1) // 2)):  # layer 3: global
        flops = forward_flops(
            _one_layer(layer), seq_len=S, images=0, tokens_per_image=0
        )
        matmul, attention = flops["decoder"]
        # wq, wo: 6656 x (32 heads x 128); wk, wv: 6656 x (2 x 128); w1-3: 6656 x 19968
        assert matmul == 2 * S * (2 * 6656 * 4096 + 2 * 6656 * 256 + 3 * 6656 * 19968)
        # per query and key: q.k and p.v over 32 heads x 128, a multiply-add each
        assert attention == 4 * 4096 * keys
        assert flops["lm_head"] == (2 * S * 6656 * 202048, 0)


def test_one_30b_vision_block_by_hand():
    # 256 tokens: 32 x 32 = 1024 patches (2 x 2 merged), one window of 32 x 32.
    flops = forward_flops(_one_layer(0), seq_len=S, images=2, tokens_per_image=256)
    matmul, attention = flops["vision"]
    # q, k, v, proj: 1536 x 1536; fc1, fc2: 1536 x 8960; patches in: 1176 x 1536
    block = 2 * 1024 * (4 * 1536 * 1536 + 2 * 1536 * 8960)
    assert matmul == 2 * (block + 2 * 1024 * 1176 * 1536)
    assert attention == 2 * 4 * 1536 * 1024 * 1024  # one global block
    # adapter 6144 -> 4096 -> 4096, then 4096 -> 6656, per token
    adapter = 6144 * 4096 + 4096 * 4096 + 4096 * 6656
    assert flops["adapter"] == (2 * 2 * 256 * adapter, 0)


SPACE = dict(cp=[1, 2], tp=[1], pp=[1], ac=["none", "full"], vision=["replicated"])


def _choose(gpu_memory_gb: float) -> list[dict]:
    return choose(
        ["--job.config_file", str(TRAIN_CONFIGS / "fsdp2.toml")],
        gpus=2,
        gpu_memory_gb=gpu_memory_gb,
        global_batch=2,
        images=4,
        tokens=16,
        space=SPACE,
        hardware=Hardware(),
    )


def test_the_verb_chooses_the_fastest_that_fits():
    roomy = _choose(gpu_memory_gb=1000.0)
    assert [row["seconds"] for row in roomy] == sorted(r["seconds"] for r in roomy)
    # No recomputation and no CP transfer: the fewest FLOPs and nothing exposed.
    fastest = roomy[0]
    assert (fastest["cp"], fastest["ac"]) == (1, "none")
    assert fastest["fastest_fitting"] and fastest["fits"]
    assert all("peak_bytes" not in row for row in roomy[1:])
    # The RoPE tables on paper are the planned rank's buffers (and inv_freq).
    rope = fastest["fixed_terms"]["RoPE tables"]
    assert rope <= fastest["breakdown"]["Buffer"] <= rope * 1.01

    tight = _choose(gpu_memory_gb=(fastest["peak_bytes"] - 1) / 1e9)
    planned = [row for row in tight if "peak_bytes" in row]
    assert not planned[0]["fits"] and planned[0]["cp"] == 1
    assert planned[0]["ac"] == "none"
    assert [row["fits"] for row in planned] == [False] * (len(planned) - 1) + [True]
    assert planned[-1]["fastest_fitting"]
    assert sum(bool(row.get("fastest_fitting")) for row in tight) == 1
