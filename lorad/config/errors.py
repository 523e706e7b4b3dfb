"""The one exception type for bad settings: its message is a single line for the user."""


class ConfigError(ValueError):
    """A setting, flag or model file that lorad refuses; the message names what and why."""
