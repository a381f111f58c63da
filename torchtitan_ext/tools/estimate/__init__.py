"""Memory planner: a job's memory per rank, measured on a simulated cluster.

``python -m torchtitan_ext.tools.estimate --config-file train_configs/JOB.toml
[--seq-len N] [--images N] [--vision replicated|sharded] [--section.key value]``
prints, for each rank worth simulating (``planner.ranks_to_plan``: one per
pipeline stage, and one per distinct share of the images with sharded vision),
its parameters, buffers, gradients and optimizer state, the peak forward
activations of the decoder and of the vision modules, and the step's peak.

Nothing is estimated by formula: each rank is built by
``simulated_cluster.simulated_rank`` (the job's real model, parallelize and
pipelining functions on torch's fake process group of the job's world size),
its batch (``batch``: rows of text with evenly spaced square images) prepared
by the plug-in Trainer's own hooks, then one training step runs under
``FakeTensorMode`` (``planner``), with the job's activation checkpointing,
inside torch's ``MemTracker`` / ``FSDPMemTracker`` (``tracker``: activations
filed by model region as ``benchmarks/memory_per_rank.py`` files them). The
one derived figure is the extra microbatches a pipeline stage holds (1F1B,
GPipe), printed as such. ``benchmarks/memory_planner_check.py`` compares the
planner with that real measurement on the debug job.

What the planner's step cannot run as is under FakeTensorMode and torch's
trackers, each seen on the debug job with its fix taken out, and the fix:

- torchtitan's vision encoder reads its geometry on the host
  (``vision_encoder.py:468``, ``assert bool((grid_thw[:, 0] == 1).all())``:
  ``DataDependentOutputException: aten._local_scalar_dense``; then
  ``grid_thw.tolist()`` and a boolean index): ``host_values`` carries the real
  values of integer tensors through the fake run;
- flex attention is a higher-order operator, for which the trackers have no
  rule (``NotImplementedError`` at ``attention.py:366``): they let it reach
  the fake mode, whose kernel returns its outputs and log-sum-exp only, as a
  fused GPU kernel stores them (the CPU backend's eager kernel builds
  [B, H, Lq, Lk] scores, which the measurement counts apart as scratch);
- the chunked loss calls ``lm_head`` once per chunk, which FSDPMemTracker
  refuses ("multiple iterative calls", at ``loss.py:748``), and DTensor's
  sharding propagation makes fake tensors of global shapes in the planner's
  fake mode, which the trackers counted (25% on the debug job's peak, in
  ``clip_grad_norm_``): see ``tracker``.

The batch is prepared (the CP mask rewrite, the ptrr balancer,
``create_block_mask``) on real tensors before the fake mode, as the
measurement prepares it before its tracker; it is not tried under the fake
mode. The spmd_types collectives run on the fake process group as they are.
``python -m torchtitan_ext.tools.estimate.fit`` finds the smallest CP degree at
which a job fits given GPU sizes (``fit``).
"""
