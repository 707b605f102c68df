"""Data layer: indexed datasets, tokenizers, chat rendering, pack planning, THD batches, loader."""
