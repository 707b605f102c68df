"""Training part of a model: LoRA adapters (and their merged or PEFT export) and frozen parts."""
