"""The planner's tests' ``PlanInputs`` from the training flags' names, as the command line takes
them: the memory section's fields (``MemoryMode``'s own names), ``optimizer`` and the options
the registered optimizers declare (those ``optimizer`` does not declare are ignored, as the
trainer ignores ``--muon-momentum`` under ``--optimizer adamw``), the rest ``PlanInputs``' own."""
from __future__ import annotations

from core.memory_mode import MemoryMode
from core.optim import registry
from training.planner.inputs import PlanInputs, optim_options


def inputs(optimizer: str = "muon", **kw) -> PlanInputs:
    mode = MemoryMode(**{k: kw.pop(k) for k in MemoryMode.flag_names() if k in kw})
    declared = {n for name in registry.names() for n in registry.get(name).option_names()}
    options = {k: kw.pop(k) for k in declared if k in kw}
    return PlanInputs(mode=mode, optim=optim_options(optimizer, **options), **kw)
