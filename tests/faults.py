"""The training entry point with a fault planted, as a bad sample or a dying rank would.

``TRAIN_FILE=tests.faults TORCHTITAN_EXT_FAULT=<fault> ./run_train.sh``
plants one of ``FAULTS`` in every rank's process (no file is edited), then
trains as ``torchtitan_ext.train`` does:

- ``drop_sample``: the rank named by ``TORCHTITAN_EXT_FAULT_RANK`` drops
  one raw sample silently (as a catch-all skipper or a timed-out image fetch
  would), the first it reads after its loader has yielded the first batch; the
  other ranks of its group read that sample.
- ``short_grid``: on every rank, the second batch's first image gets a grid one
  patch row short of its pixels (a collator or processor bug).
- ``nan_pixel``: on every rank, the sample whose key is
  ``TORCHTITAN_EXT_FAULT_SAMPLE`` comes out of the sample processor with one
  NaN pixel (a float image, a processor bug).
- ``kill_in_save``: the rank named by ``TORCHTITAN_EXT_FAULT_RANK`` kills
  itself (SIGKILL) in its second checkpoint save, once its shard is written
  and before the checkpoint's ``.metadata`` can be: a save cut short.
- ``late_node``: the ranks of the node named by ``TORCHTITAN_EXT_FAULT_NODE``
  (torchrun's ``GROUP_RANK``) sleep ``TORCHTITAN_EXT_FAULT_DELAY_S`` seconds
  as they start building the trainer, as ranks importing from a cold
  filesystem would be late.
"""

import os
import signal
import time

from torchtitan_ext import cpu_backend

FAULT_ENV = "TORCHTITAN_EXT_FAULT"
RANK_ENV = "TORCHTITAN_EXT_FAULT_RANK"
SAMPLE_ENV = "TORCHTITAN_EXT_FAULT_SAMPLE"
NODE_ENV = "TORCHTITAN_EXT_FAULT_NODE"
DELAY_ENV = "TORCHTITAN_EXT_FAULT_DELAY_S"


def _batches_counted(data, state: dict) -> None:
    collate = data._CountingCollator.__call__

    def counted(self, samples):
        state["batches"] += 1
        input_dict, labels = collate(self, samples)
        if state.get("short_grid") and state["batches"] == 2:
            input_dict["grid_thw"][0, 1] -= 1
        return input_dict, labels

    data._CountingCollator.__call__ = counted


def _drop_one_sample_after_the_first_batch() -> None:
    from torchtitan_ext.muse_glimmer import data

    state = {"batches": 0, "dropped": False}
    _batches_counted(data, state)
    if os.environ["RANK"] != os.environ[RANK_ENV]:
        return
    process = data.SampleSkipper.__call__

    def dropping(self, **kwargs):
        processed = process(self, **kwargs)
        if state["batches"] and not state["dropped"] and processed is not None:
            state["dropped"] = True
            return None
        return processed

    data.SampleSkipper.__call__ = dropping


def _short_grid_at_the_second_batch() -> None:
    from torchtitan_ext.muse_glimmer import data

    _batches_counted(data, {"batches": 0, "short_grid": True})


def _nan_pixel_in_one_sample() -> None:
    from torchtitan_ext.muse_glimmer import data

    init = data.SampleSkipper.__init__

    def poisoning(self, process, *args, **kwargs):
        def processed(*, sample, **kw):
            out = process(sample=sample, **kw)
            if sample.get("__key__") == os.environ[SAMPLE_ENV]:
                out["pixel_values"][0].view(-1)[0] = float("nan")
            return out

        init(self, processed, *args, **kwargs)

    data.SampleSkipper.__init__ = poisoning


def _kill_in_the_second_save() -> None:
    if os.environ["RANK"] != os.environ[RANK_ENV]:
        return
    from torch.distributed.checkpoint import filesystem

    write_data = filesystem._FileSystemWriter.write_data
    saves = []

    def killed_after_writing(self, plan, planner):
        written = write_data(self, plan, planner)
        saves.append(written.wait())
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    filesystem._FileSystemWriter.write_data = killed_after_writing


def _late_node() -> None:
    if os.environ["GROUP_RANK"] != os.environ[NODE_ENV]:
        return
    from torchtitan_ext.muse_glimmer.trainer import MuseGlimmerTrainer

    init = MuseGlimmerTrainer.__init__

    def late(self, config):  # imports done, config parsed: the delay alone
        time.sleep(float(os.environ[DELAY_ENV]))
        init(self, config)

    MuseGlimmerTrainer.__init__ = late


FAULTS = {
    "drop_sample": _drop_one_sample_after_the_first_batch,
    "short_grid": _short_grid_at_the_second_batch,
    "nan_pixel": _nan_pixel_in_one_sample,
    "kill_in_save": _kill_in_the_second_save,
    "late_node": _late_node,
}


def main() -> None:
    cpu_backend.apply()
    FAULTS[os.environ[FAULT_ENV]]()
    from torchtitan_ext import train

    train.main()


if __name__ == "__main__":
    main()
