"""The mesh's axis names and sizes, from the config and a device count alone (no JAX).

The one implementation of "fill the `-1` axis with the devices left": `mesh.py` builds the device
mesh with it, and the launcher (`jaxtrain.launch.elastic`, which must not import JAX) plans a
smaller job with it.
"""

from __future__ import annotations

import math

from jaxtrain.config import MESH_AXES, ConfigError, MeshConfig

AXES = MESH_AXES  # the mesh axes, outermost first: one list, kept in jaxtrain.config (which imports nothing here)


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Sizes for every mesh axis, filling the one `-1` axis with the remaining devices.

    Raises:
      ConfigError: a size that is neither positive nor -1, or sizes that do not multiply to `num_devices`.
    """
    sizes = {a: getattr(mesh_cfg, a) for a in AXES}
    for a, v in sizes.items():  # load_config checks this too; a MeshConfig built in Python may skip it
        if v == 0 or v < -1:
            raise ConfigError(f"config key 'mesh.{a}' must be a positive size or -1 (fill), got {v}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    described = ", ".join(f"{a}={v}" for a, v in sizes.items())
    if fill:
        if num_devices % fixed:
            raise ConfigError(f"mesh ({described}) does not divide the {num_devices} devices: "
                              f"the fixed axes multiply to {fixed}")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(f"mesh ({described}) multiplies to {fixed} but there are {num_devices} devices; "
                          "make the product match or set one axis to -1")
    return sizes
