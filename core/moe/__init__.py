"""moe: filled in by the model and parallelism issues."""
