"""Development tooling of torchtitan_ext, kept off the model package's import path.

``parity`` (baseline-vs-test training comparisons), ``vision_probe`` and
``probe_seeds`` (does a checkpoint use the images?), ``hf_checkpoint`` (HF
weights in and out), ``simulated_cluster`` (one rank of a production job,
built and parallelized on a fake process group of its world size),
``estimate`` (the memory planner on that simulated cluster) and
``local_ranks`` (a function on N local gloo ranks, for tests and benchmarks);
the commands run with ``python -m``.
"""
