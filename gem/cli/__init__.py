"""Command-line entry points (console scripts declared in pyproject.toml): gem (train | plan | bench), gem-train, gem-bench,
gem-plan."""
