"""Checkpoints in and out: training checkpoints (sharded, atomic, read without running code),
their directory protocol, Hugging Face safetensors import and export, and the export folders'
policy."""
