"""The errors a user's input can raise, in a leaf module every other module may import."""


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key."""
