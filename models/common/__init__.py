"""Pieces families share: the decoder-only chunk every family's model is built on."""
