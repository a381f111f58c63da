"""``python -m torchtitan_ext.tools.estimate``: see the package's docstring."""

from .cli import main

main()
