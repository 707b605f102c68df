"""Transformer building blocks on THD input: RMSNorm, rotary embeddings, attention, SwiGLU."""
