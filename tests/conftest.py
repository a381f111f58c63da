"""Switch torchtitan to the CPU backend before any test imports it."""

from torchtitan_ext import cpu_backend

cpu_backend.apply()
