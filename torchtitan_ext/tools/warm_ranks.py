"""Imported once by ``local_ranks``' fork server: every rank forked from it
starts with torchtitan imported (7 s of CPU a rank, ~300 rank starts a CI run)."""

from torchtitan_ext import cpu_backend

cpu_backend.apply()

import torchtitan.train  # noqa: E402, F401

import torchtitan_ext.muse_glimmer  # noqa: E402, F401
