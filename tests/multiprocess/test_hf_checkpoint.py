"""Hugging Face weights in and out of the CP jobs, and transformers as reference.

One Hugging Face checkpoint of the debug model (``tools.hf_checkpoint``:
seeded, constant-initialised parameters drawn) and a DCP checkpoint of the
same weights. Each CP job loads the HF one with torchtitan's own
``--checkpoint.initial_load_in_hf`` (``tests/hf_load_worker.py`` on torchrun
ranks, the real Trainer) and must hold, on every rank, bitwise the shards the
DCP one gives: the state-dict adapter's q/k permutes run on DTensors sharded
over FSDP, TP and cp. CP2 (both vision modes) and CP4 (sharded) also give
their logits on ``hf_reference.BATCHES``, compared with transformers'
``MuseGlimmerForConditionalGeneration`` on the same checkpoint at the bounds of
``tests/unit/test_transformers_reference.py`` (one image's rows off by one
must fail them). CP2 sharded then trains a step and exports with
``--checkpoint.last_save_in_hf``: the export is its trained state, bitwise,
and transformers loads it. The packed parity suite (``test_parity_cp.py``)
trains every CP job from the seed in HF format, held to 1 rank's within the
fp32 floor: CI, with fewer parity steps, leaves TP2 + CP2 + SP and CP2 x PP2
to it, and CP4 with sharded vision to the suite's CP4 (its load) and unpacked
CP4 sharded parity (its forward) (``SUITE_COVERED``); the default
``./run_tests.sh`` runs every job here.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from torchtitan_ext.muse_glimmer import model_registry
from torchtitan_ext.tools.hf_checkpoint import (
    FLAVOR,
    seeded_state_dict,
    write_hf_checkpoint,
)

from ..hf_reference import BATCHES, caption_loss, hf_logits, make_batch, relative_error
from ..jobs import toml_ranks
from ..parity_suites import FULL
from ..training_runs import REPO
from ..unit.test_transformers_reference import LOGIT_REL_TOL, LOSS_TOL

TIMEOUT_S = 600
SHARDED = ["--parallelism.context_parallel_vision", "sharded"]
SEQ = ["--training.seq_len", "512", "--training.local_batch_size", "2"]

# job: (TOML, flags, compare logits with transformers)
JOBS = {
    "cp2": ("cp2.toml", [], True),
    "cp2_sharded_vision": ("cp2.toml", SHARDED, True),
    "cp4_sharded_vision": ("cp4.toml", SHARDED, True),
    "tp2_cp2_sp": ("tp2_cp2_sp.toml", [], False),
    "cp2_pp2": ("cp2_pp2.toml", [], False),
    "fsdp2_cp2_sharded_vision": ("fsdp2_cp2.toml", SHARDED, False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf_checkpoint")
    state = seeded_state_dict(0)
    dcp.save(state, checkpoint_id=str(out / "dcp"))
    batches = [(name, make_batch(name)) for name in BATCHES]
    torch.save(
        [
            (n, {"input_dict": b["input_dict"], "labels": b["labels"]})
            for n, b in batches
        ],
        out / "batches.pt",
    )
    return {
        "hf": write_hf_checkpoint(out / "hf", state),
        "dcp": out / "dcp",
        "batches": out / "batches.pt",
        "out": out,
    }


@pytest.fixture(scope="module")
def reference_logits(checkpoints) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import MuseGlimmerForConditionalGeneration

    model = MuseGlimmerForConditionalGeneration.from_pretrained(
        checkpoints["hf"], attn_implementation="eager"
    ).eval()
    return {
        name: (hf_logits(model, batch["hf_rows"]), batch["labels"])
        for name, batch in ((name, make_batch(name)) for name in BATCHES)
    }


EXPORTING_JOB = "cp2_sharded_vision"
# Trained from the HF seed by the packed suite too; CI keeps them there only.
SUITE_COVERED = {"tp2_cp2_sp", "cp2_pp2", "cp4_sharded_vision"}


def _run_worker(checkpoints, job: str) -> dict:
    """``hf_load_worker`` on ``job``: the DCP comparison, logits, export as set."""
    toml, flags, compare_logits = JOBS[job]
    out = checkpoints["out"] / job / "results.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    options = ["--dcp", str(checkpoints["dcp"])]
    if compare_logits:
        options += ["--batches", str(checkpoints["batches"])]
    if job == EXPORTING_JOB:
        options.append("--export")
    command = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nproc_per_node", str(toml_ranks(toml)), "--rdzv_backend", "c10d"),
        *("--rdzv_endpoint", "localhost:0", "-m", "tests.hf_load_worker"),
        *("--hf", str(checkpoints["hf"]), "--out", str(out), *options, "--"),
        *("--job.config_file", str(REPO / "train_configs" / toml), *SEQ, *flags),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(checkpoints):
    """Each job's worker results, run once on first use."""
    cache: dict[str, dict] = {}

    def of(job: str) -> dict:
        if job not in cache:
            cache[job] = _run_worker(checkpoints, job)
        return cache[job]

    return of


@pytest.mark.parametrize(
    "job", [job for job in JOBS if FULL or job not in SUITE_COVERED]
)
def test_hf_load_equals_dcp_load_and_matches_transformers(
    results, reference_logits, job
):
    result = results(job)
    assert result["unequal_to_dcp"] == []
    if not JOBS[job][2]:
        return
    for name, (want, labels) in reference_logits.items():
        got = result["logits"][name]
        error = relative_error(got, want)
        dloss = abs(caption_loss(got, labels) - caption_loss(want, labels)).item()
        bug = result["logits_rows_off_by_one"][name]
        bug_error = relative_error(bug, want)
        print(
            f"{job} {name}: max|dlogit|/max|logit|={error:.2e} |dloss|={dloss:.2e}"
            f"; rows off by one: {bug_error:.2e}"
        )
        assert error <= LOGIT_REL_TOL and dloss <= LOSS_TOL, (name, error, dloss)
        assert bug_error > LOGIT_REL_TOL, name


def test_export_from_cp2_sharded_is_its_trained_state(checkpoints, results):
    """After its checks, CP2 sharded trains a step and exports in HF format."""
    trained = results(EXPORTING_JOB)["trained_state"]
    export = checkpoints["out"] / EXPORTING_JOB / "checkpoint" / "step-1"
    from torchtitan.models.muse_glimmer.state_dict_adapter import (
        MuseGlimmerStateDictAdapter,
    )

    hf_state = {}
    for path in export.glob("*.safetensors"):
        hf_state |= load_file(path)
    exported = MuseGlimmerStateDictAdapter(model_registry(FLAVOR).model, None).from_hf(
        hf_state
    )
    assert exported.keys() == trained.keys()
    unequal = [k for k, v in trained.items() if not torch.equal(exported[k], v)]
    assert not unequal, unequal[:5]
    seed = load_file(checkpoints["hf"] / "model.safetensors")
    assert any(not torch.equal(hf_state[k], seed[k]) for k in seed), "nothing trained"

    from transformers import MuseGlimmerForConditionalGeneration

    shutil.copy(checkpoints["hf"] / "config.json", export)
    model = MuseGlimmerForConditionalGeneration.from_pretrained(export)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in hf_state.items())
    assert (
        json.loads((export / "config.json").read_text())["model_type"] == "muse_glimmer"
    )
