"""The parts of ``tools/gpu_check.sh``: each one a module run as ``python -m
benchmarks.gpu_parts.NAME`` in a process of its own (``tools/gpu_check.py`` gives each its own
timeout), printing what it measured and writing it as JSON (``--json``). See
docs/performance.md for what each measures and how to read it."""
