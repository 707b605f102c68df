"""Command-line tools; thin wrappers over the packages."""
