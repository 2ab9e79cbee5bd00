"""jaxtrain: sharded JAX/XLA training for large transformer models."""

__version__ = "0.1.0"

from jaxtrain.config import Config, ConfigError, load_config  # noqa: E402


def __getattr__(name: str):
    # Trainer pulls in JAX; importing it lazily keeps `--cpu-devices` able to configure XLA first.
    if name == "Trainer":
        from jaxtrain.trainer import Trainer
        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "ConfigError", "Trainer", "load_config", "__version__"]
