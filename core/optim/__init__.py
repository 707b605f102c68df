"""Optimizers (Muon incl. the stateless momentum-0 path, Dion, AdamW groups) and LR schedules."""
