"""The training entry point with one rank's data diverging: the job must stop.

``TRAIN_FILE=tests.data_faults TORCHTITAN_EXT_DATA_FAULT_RANK=<rank> ./run_train.sh``
makes that rank's sample processor drop one raw sample silently (as a
catch-all skipper or a timed-out image fetch would), the first it reads after
its loader has yielded the first batch, then trains as ``torchtitan_ext.train``
does. The other ranks of its group read that sample.
"""

import os

from torchtitan_ext import cpu_backend

RANK_ENV = "TORCHTITAN_EXT_DATA_FAULT_RANK"


def _drop_one_sample_after_the_first_batch() -> None:
    from torchtitan_ext.muse_glimmer import data

    collate, process = data._CountingCollator.__call__, data.SampleSkipper.__call__
    state = {"batches": 0, "dropped": False}

    def counted(self, samples):
        state["batches"] += 1
        return collate(self, samples)

    def dropping(self, **kwargs):
        processed = process(self, **kwargs)
        if state["batches"] and not state["dropped"] and processed is not None:
            state["dropped"] = True
            return None
        return processed

    data._CountingCollator.__call__ = counted
    data.SampleSkipper.__call__ = dropping


def main() -> None:
    cpu_backend.apply()
    if os.environ["RANK"] == os.environ[RANK_ENV]:
        _drop_one_sample_after_the_first_batch()
    from torchtitan_ext import train

    train.main()


if __name__ == "__main__":
    main()
