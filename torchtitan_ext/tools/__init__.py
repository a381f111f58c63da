"""Development tooling of torchtitan_ext, kept off the model package's import path.

The commands run with ``python -m``; README's "Package layout" lists them.
"""
