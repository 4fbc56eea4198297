"""The one error a user's configuration can cause: printed as a single line, exit status 2."""


class ConfigError(ValueError):
    """A bad override or an impossible combination. The message names the key and the fix."""
