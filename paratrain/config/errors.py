"""The one error type for invalid settings.

Every message follows one shape: the rule that was broken, the numbers that broke it, and a fix.
"""


class ConfigError(ValueError):
    """A setting, or a combination of settings, that paratrain refuses before anything runs."""
