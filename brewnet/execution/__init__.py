"""How a net executes: everything between a layer's torch ops and the run a user asked for.

``threads`` (the one owner of torch's thread counts), ``determinism`` (which kernels keep their
bits on any thread count), ``process`` (process-wide settings: device, TF32, the allocator),
``recording`` (a run's aten ops recorded as a torch.fx graph and replayed), ``recorded_step``,
``recorded_update`` and ``recorded_fused_step`` (a training step, the solver's update and K
fused nets' step as recordings), ``steps_per_call`` (K iterations in one call), ``passes`` (FX
passes over those recordings), ``cuda_graph`` (a recording captured as a CUDA graph), ``lean``
(repeated inference as one recording), ``folding`` (BatchNorm/Scale folded into convolutions)
and ``fast_path`` (the one guard every automatic switch runs behind). The map and the reasons:
docs/internals.md.
"""
