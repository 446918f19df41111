"""The diffusion layer's error: a diffusers folder, component config or option hypertron cannot use."""

from hypertron.errors import ConfigError


class DiffusionError(ConfigError):
    """A diffusers folder, file, config key or option that cannot be used; one line naming the file and
    the key, tensor or value (the CLI prints it as ``error: ...`` and exits 2)."""
