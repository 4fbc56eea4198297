"""The errors a user's input can cause: each printed as a single line, exit status 2."""


class ConfigError(ValueError):
    """A bad override or an impossible combination. The message names the key and the fix."""


class CheckpointRefused(ConfigError):
    """A checkpoint file that does not match its manifest, is not only tensors and plain
    containers, or cannot be read. The message names the file; nothing in it was loaded."""
