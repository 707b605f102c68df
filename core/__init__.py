"""Model-agnostic training machinery: THD contract, parallel state, pipeline, MoE, optimizers."""
