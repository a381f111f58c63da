"""Development tooling of torchtitan_ext, kept off the model package's import path.

``parity`` (baseline-vs-test training comparisons), ``vision_probe`` (does a
checkpoint use the images?), ``embedded_data`` (the generated data set and
tokenizer the jobs train on), ``simulated_cluster`` (one rank of a production
job, built and parallelized on a fake process group of its world size) and
``estimate`` (the memory planner: each rank's memory in one training step of a
job, run under FakeTensorMode on that simulated cluster; ``estimate.fit``, the
smallest CP degree that fits given GPU sizes); each runs with ``python -m``.
"""
