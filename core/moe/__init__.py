"""Mixture of experts: sigmoid router, token dispatchers, grouped experts, the MoE layer."""
