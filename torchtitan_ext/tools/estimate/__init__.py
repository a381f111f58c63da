"""Memory planner: a job's memory per rank, measured on a simulated cluster.

Nothing is estimated by formula: each rank is the job's real model, parallelized
on torch's fake process group (``simulated_cluster``); its batch (``batch``) is
prepared by the plug-in Trainer's hooks on real tensors, as the measurement
(``benchmarks/memory_per_rank.py``) prepares it; then one training step runs
under ``FakeTensorMode`` inside torch's ``MemTracker`` / ``FSDPMemTracker``
(``tracker``). What the fake step could not run as is, and the fix:

- torchtitan's vision encoder reads ``grid_thw`` on the host
  (``vision_encoder.py:468``, ``DataDependentOutputException``): ``host_values``
  carries integer tensors' real values through the fake run;
- flex attention is a higher-order operator the trackers have no rule for
  (``NotImplementedError`` at ``attention.py:366``): they let it reach the fake
  mode, whose kernel returns outputs and log-sum-exp only, as a fused GPU
  kernel stores them (no [B, H, Lq, Lk] scores);
- the chunked loss calls ``lm_head`` once per chunk, which FSDPMemTracker
  refuses (``loss.py:748``), and DTensor's sharding propagation makes fake
  tensors of global shapes, which the trackers counted: see ``tracker``.
"""
