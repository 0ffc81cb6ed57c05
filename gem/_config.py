"""Old name of gem.config's error types and config builders (gem/data still imports it): the same objects."""

from gem.config import Checker, ConfigError, UserError, build, one_of, show, to_plain

__all__ = ["Checker", "ConfigError", "UserError", "build", "one_of", "show", "to_plain"]
