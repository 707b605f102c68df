"""The memory trace (``--trace``): one rank's real build, ``parallelize`` and ``train_step`` on
fake tensors in a fake process group, its live bytes counted at every allocation and free, to
check the planner's formulas (``training/planner/``) against what the code allocates. See
``runner.py`` for what it assumes and docs/memory.md ("The traced peak")."""
