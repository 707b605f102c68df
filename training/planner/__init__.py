"""The run planner: what each rank of a layout holds and how long its step takes, without
allocating anything, fed by the memory mode (``core/memory_mode.py``) and the model family's
shares built on the meta device.

- ``shares.py``: each pipeline rank's share of the model (meta tensors with their roles) and the
  schedule's facts (in-flight micro-batches, p2p buffers);
- ``inputs.py``: what one plan is of (``PlanInputs``: the layout, the batch, the ``MemoryMode``
  and the optimizer with its declared options);
- ``memory.py``: bytes per rank on the device and the host (``plan``);
- ``timing.py``: the predicted step time (``plan_time``) under stated assumptions;
- ``search.py``: every layout and memory mode of a world size, planned and ranked;
- ``run.py``: the training flags' view (``pretrain_step37.py --dry-run``, ``tools/plan_memory.py``).
"""
