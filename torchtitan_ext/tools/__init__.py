"""Development tooling of torchtitan_ext, kept off the model package's import path.

``parity`` (baseline-vs-test training comparisons), ``vision_probe`` (does a
checkpoint use the images?) and ``embedded_data`` (the generated data set and
tokenizer the jobs train on); each runs with ``python -m``.
"""
