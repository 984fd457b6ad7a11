"""The parts every train engine shares, so fsdp, megatron and a third party's engine build them once.

- :mod:`~areal_core.engine_kit.setup`: run config, device, model folder.
- :mod:`~areal_core.engine_kit.collectives`: a count agreed over the ranks, a barrier.
- :mod:`~areal_core.engine_kit.packing`: which sequences each data-parallel rank and micro-batch takes
  (balanced partition, first-fit packing), and transfer buckets.
- :mod:`~areal_core.engine_kit.optim`: AdamW parameter groups, the learning-rate schedule.
- :mod:`~areal_core.engine_kit.hf_folder`: HF model folders written atomically and read back.
- :mod:`areal_core.train_batches`: the packed batch as tensors, micro-batch slicing, PPO mini-batches, stats.

Importing the package imports no torch; the modules that need it import it on first use.
"""
