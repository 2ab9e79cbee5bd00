"""A stored loss curve: the first 50 per-step losses of configs/tiny.yaml on one CPU device.

Any change to initialisation, the data order, the optimizer, the schedule or the model's math moves
these numbers; the test catches it the day it lands. A deliberate change regenerates the file:

    JAXTRAIN_UPDATE_BASELINE=1 python -m pytest tests/test_loss_baseline.py

and says why in its commit. The tolerance allows for XLA versions (jax 0.10 vs 0.12) reordering
float reductions, not for a changed computation (those move the curve by 1e-2 and more).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from helpers import TINY

from jaxtrain.config import load_config
from jaxtrain.trainer import Trainer

BASELINE = Path(__file__).parent / "baselines" / "tiny_losses.json"
STEPS = 50
TOLERANCE = 1e-4  # relative, per step (jax 0.10 and 0.12 agree to 2e-7)


def tiny_losses() -> list[float]:
    cfg = load_config(TINY, [f"train.steps={STEPS}", "checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    losses = [trainer.step()["loss"] for _ in range(STEPS)]
    trainer.close()
    return losses


def test_tiny_loss_curve_matches_the_stored_baseline():
    losses = tiny_losses()
    if os.environ.get("JAXTRAIN_UPDATE_BASELINE") == "1":
        BASELINE.write_text(json.dumps({"config": "configs/tiny.yaml", "steps": STEPS, "devices": 1,
                                        "jax": jax.__version__, "losses": losses}, indent=1) + "\n")
    stored = json.loads(BASELINE.read_text())["losses"]
    assert len(stored) == STEPS
    np.testing.assert_allclose(losses, stored, rtol=TOLERANCE)
    assert stored[0] - stored[-1] > 1.0  # the stored curve is a learning curve, not a flat line
