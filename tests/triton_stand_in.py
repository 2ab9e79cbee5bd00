"""Running the Triton kernels on the CPU: the Triton interpreter, and a stand-in for
`jax_triton.triton_call` that launches the kernels the same way inside a `jax.pure_callback`
(real jax-triton needs an NVIDIA GPU). The JAX wrappers in kernels/triton_attention.py then run
unchanged: their launch plans, argument order, output buffers and dtypes are what is tested.

Importing this module sets TRITON_INTERPRET=1 and reloads kernels.triton_attention, whose
@triton.jit decorators choose the interpreter when they run. Test-only dependencies (the `dev`
extra): torch and triton.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types

os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402  (a missing one is a failure, not a skip)
import triton  # noqa: E402,F401  (imported for its presence: the interpreter needs it)

# Reload in case something imported the module before TRITON_INTERPRET was set.
triton_attention = importlib.reload(importlib.import_module("jaxtrain.kernels.triton_attention"))

# The interpreter patches triton.language for the duration of a launch: two launches at once (the
# callbacks of several simulated devices run on their own threads) break each other.
_INTERPRETER = threading.Lock()

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}


def to_torch(x) -> "torch.Tensor":
    a = np.asarray(x)
    if a.dtype == ml_dtypes.bfloat16:  # torch.from_numpy knows no bfloat16: go through the bits
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def fake_triton_call(*args, kernel, out_shape, grid, name="", num_warps=None, num_stages=None, **metaparams):
    """jax_triton.triton_call's contract: array args and Python scalars in order, then one pointer
    per `out_shape` entry appended, `metaparams` as constexpr keywords; one array or a list back."""
    single = not isinstance(out_shape, (list, tuple))
    out_shapes = [out_shape] if single else list(out_shape)
    array_positions = [i for i, a in enumerate(args) if not isinstance(a, (bool, int, float))]

    def host(*arrays):
        call_args = list(args)
        for i, a in zip(array_positions, arrays):
            call_args[i] = to_torch(a)
        outs = [torch.empty(s.shape, dtype=TORCH_DTYPES[jnp.dtype(s.dtype).name]) for s in out_shapes]
        with _INTERPRETER:
            kernel[grid](*call_args, *outs, **metaparams)
        return [to_numpy(o) for o in outs]

    results = jax.pure_callback(host, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes],
                                *[args[i] for i in array_positions])
    return results[0] if single else results


@pytest.fixture
def fake_jax_triton(monkeypatch):
    """`import jax_triton` gives the interpreter-backed stand-in for the test's duration."""
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=fake_triton_call))
