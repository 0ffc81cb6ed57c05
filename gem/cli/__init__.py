"""Command-line entry points (console scripts declared in pyproject.toml): gem-train, gem-bench, gem-plan."""
