"""Persistent XLA compilation cache: a restarted job loads its compiled programs from disk."""

from __future__ import annotations

import os
from typing import Optional

import jax

from jaxtrain.checkpoint.layout import is_local


def enable_compilation_cache(directory: Optional[str]) -> Optional[str]:
    """Turn on JAX's persistent compilation cache so a restarted job skips recompiling.

    Args:
      directory: cache folder (`~` expanded, created if needed) or a URL; None/"" turns it off
        (also when an earlier Trainer in this process turned it on).
    Returns:
      The folder in use, or None.
    """
    from jax.experimental.compilation_cache import compilation_cache

    if not directory:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    path = os.path.abspath(os.path.expanduser(directory)) if is_local(directory) else directory
    if is_local(path):
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # By default only programs that took >= 1 s to compile are stored; a restart pays for every
    # program it compiles, and small CPU programs add up, so store everything.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX decides once per process whether the cache is in use; if something compiled before
    # this call, that decision was "no". Reset it so the next compile looks again.
    compilation_cache.reset_cache()
    return path
