"""jaxtrain: sharded JAX/XLA training for large transformer models."""

import sys as _sys

__version__ = "0.1.0"

from jaxtrain.config import Config, ConfigError, load_config  # noqa: E402


class _SourceTreeKernels:
    """Finds `jaxtrain.kernels` in a source checkout on PYTHONPATH that is not installed (the
    offline GPU check: tpu_gpu_setup/gpu/install.sh --offline): the repository's top-level kernels/.
    An install maps that folder itself (pyproject.toml's package-dir: the wheel holds
    jaxtrain/kernels/, the editable install's finder comes first), so this finder, last on
    sys.meta_path, is then never asked."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "jaxtrain.kernels":
            return None
        import importlib.util
        import os
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        folder = os.path.join(root, "kernels")
        if not (os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isfile(os.path.join(folder, "__init__.py"))):
            return None  # not a source checkout
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if not any(getattr(f, "__qualname__", None) == _SourceTreeKernels.__qualname__ for f in _sys.meta_path):
    _sys.meta_path.append(_SourceTreeKernels)  # once, also when jaxtrain is reloaded


def __getattr__(name: str):
    # Trainer pulls in JAX; importing it lazily keeps `--cpu-devices` able to configure XLA first.
    if name == "Trainer":
        from jaxtrain.trainer import Trainer
        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "ConfigError", "Trainer", "load_config", "__version__"]
