"""Config changes on resume: what differs from the config a run was trained with, and which of
those changes need the user's consent (`run.allow_changes`).

Rerunning `jaxtrain train` on an existing run directory resumes from its latest checkpoint with the
config given now. Some keys may change freely then: logging, evaluation and checkpoint cadence,
fault handling, monitoring, drills, the mesh (restoring onto another mesh is a feature). Others
would silently alter what was already trained: the model, the data stream the checkpoint's data
position refers to, the optimizer and its learning-rate schedule, the precision policy, the seed.
A change of those stops the run (ConfigError: exit 2, before anything is written) unless the user
names its key in `run.allow_changes` (or gives `all`). Every change, allowed or consented, is
recorded as one `config_changed` event.

The stored config is the one saved in the extra of the run's latest persistent checkpoint (what
`Trainer._maybe_save` writes), else the run's `config.yaml` (a resume from the local tier alone).
The trainer calls `check_resume` once, right before it restores, on every process: process 0 reads
and decides, the others get its answer (`Checkpointer.agree`), so all of them stop or go on together.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

import yaml

from jaxtrain.storage import object_store, small_files
from jaxtrain.storage.paths import join
from jaxtrain.config import Config, ConfigError, from_dict
from jaxtrain.train.schedules import learning_rate_schedule, same_rates

ALLOW_KEY = "run.allow_changes"  # the consent key; never compared itself

# Sections whose every key shapes what was trained (new keys too, until listed in HARMLESS), and why.
GUARDED_SECTIONS = {
    "model": "the checkpoint's parameters were trained as the old model",
    "data": "the checkpoint's data position and the batches trained so far belong to the old data stream",
    "optim": "the optimizer state and the learning rates so far followed the old value",
}
# Keys of those sections that change how the same thing is computed, not what: free to change.
HARMLESS = {
    "model.attention",  # another kernel for the same attention
    "model.remat",  # what the backward pass recomputes
    "model.scan_layers",  # a different parameter layout is refused by the restore's own check
    "data.prefetch",  # batches prepared ahead
    "data.tokenize_workers",  # who tokenizes, not what
    "data.eval",  # the held-out set is not trained on
}
# Keys of the other sections that shape what was trained, and why.
GUARDED_KEYS = {
    "run.seed": "it seeded the parameter init and the random stream of the steps so far",
    "precision.policy": "the steps so far were computed in the old precision",
    "stability.z_loss": "it is part of the loss the steps so far minimised",
}
# Keys that change the learning-rate schedule only through its length (schedules.schedule_steps) or
# where its final decay starts (a WSD run's): judged by `check_changes` on the rates already used.
SCHEDULE_LENGTH = ("train.steps", "optim.decay_steps", "optim.wsd_decay_steps")


@dataclasses.dataclass(frozen=True)
class Change:
    """One dotted config key whose value differs from the stored config."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    """A value as it would be written in an override (null, 3e-4, [a, b])."""
    return json.dumps(value) if not isinstance(value, str) else value


def flatten(cfg: dict) -> dict[str, Any]:
    """{'section.key': value} of a config dict shaped like `Config.to_dict()`. Values stay whole
    (mesh.rules or data.mixture is one key)."""
    return {f"{section}.{key}": value for section, keys in cfg.items() if isinstance(keys, dict)
            for key, value in keys.items()}


def diff_configs(old: dict, new: dict) -> list[Change]:
    """The keys whose value in `new` differs from `old`, sorted by key.

    Args:
      old: the stored config (a `Config.to_dict()` as saved, possibly by an older version).
      new: the config of this start, same shape.
    A key that `old` lacks (it predates the key) counts as holding its default; a key that `new`
    lacks (it is gone) is ignored. `run.allow_changes` is never compared.
    """
    # As stored (JSON or YAML): a tuple-valued key reads back as a list, and must not count as changed.
    plain = lambda cfg: json.loads(json.dumps(cfg))
    defaults, before, after = flatten(plain(Config().to_dict())), flatten(plain(old)), flatten(plain(new))
    changes = []
    for key in sorted(after):
        if key == ALLOW_KEY:
            continue
        was = before.get(key, defaults.get(key))
        if was != after[key]:
            changes.append(Change(key, was, after[key]))
    return changes


def reason_refused(key: str) -> Optional[str]:
    """Why a change of `key` alters what was already trained, or None when it is harmless. The
    schedule's length (SCHEDULE_LENGTH) is judged by `check_changes`, not here."""
    if key in HARMLESS:
        return None
    if key in GUARDED_KEYS:
        return GUARDED_KEYS[key]
    return GUARDED_SECTIONS.get(key.split(".", 1)[0])


def allowed_keys(cfg: Config) -> set[str] | None:
    """The keys `run.allow_changes` consents to; None means all of them."""
    allow = cfg.run.allow_changes
    if allow == "all" or (isinstance(allow, list) and "all" in allow):
        return None
    return set(allow)


def _old_config(stored: dict, cfg: Config) -> Optional[Config]:
    """The stored config as a Config (keys it lacks from `cfg`), or None when it no longer builds."""
    data = cfg.to_dict()
    for key, value in flatten(stored).items():
        section, name = key.split(".", 1)
        if name in data.get(section, {}):
            data[section][name] = value
    try:
        return from_dict(data)
    except ConfigError:
        return None


def schedule_length(cfg: Config) -> int:
    """The schedule's length as configured: optim.decay_steps, or train.steps when that is unset."""
    return cfg.optim.decay_steps if cfg.optim.decay_steps is not None else cfg.train.steps


def _schedule_reason(old: Optional[Config], cfg: Config, step: int) -> str:
    """Why changing the schedule's length (or a WSD decay's) at `step` matters, with the jump in
    learning rate."""
    new_total = schedule_length(cfg)
    if old is None:
        return f"the learning-rate schedule would be re-stretched to {new_total} steps"
    old_total = schedule_length(old)
    what = (f"re-stretched from {old_total} to {new_total} steps" if old_total != new_total else
            f"changed (optim.wsd_decay_steps {old.optim.wsd_decay_steps} -> {cfg.optim.wsd_decay_steps})")
    # The update of step N uses the schedule at N - 1 (optax counts the updates applied before it).
    was, now = float(learning_rate_schedule(old)(max(step - 1, 0))), float(learning_rate_schedule(cfg)(step))
    return (f"the learning-rate schedule would be {what}: the learning "
            f"rate would jump from {was:.2e} at step {step} to {now:.2e} at step {step + 1}")


def check_changes(stored: dict, cfg: Config, step: int) -> tuple[list[Change], list[tuple[Change, str]]]:
    """The changes from `stored` to `cfg` on a resume from `step`, and those that alter what was
    already trained, each with why (consent is not applied here).

    train.steps, optim.decay_steps and optim.wsd_decay_steps (SCHEDULE_LENGTH) count only when they
    change a learning rate already used, at an update count below `step`: train.steps=600 with
    optim.decay_steps=300 on a run trained with train.steps=300 extends it at its final learning
    rate, and a longer train.steps of a WSD run still in its stable phase moves only the decay that
    has not started yet; both are harmless. Any other optim key (optim.schedule too) is refused.
    """
    changes = diff_configs(stored, cfg.to_dict())
    old = _old_config(stored, cfg)
    stretched = old is None or not same_rates(learning_rate_schedule(old), learning_rate_schedule(cfg), step)
    refused = []
    for change in changes:
        if change.key in SCHEDULE_LENGTH:
            why = _schedule_reason(old, cfg, step) if stretched else None
        else:
            why = reason_refused(change.key)
        if why is not None:
            refused.append((change, why))
    return changes, refused


def refusal_message(refused: list[tuple[Change, str]], stored: dict, cfg: Config, step: int, where: str) -> str:
    """The one line that stops a resume: which keys changed (old -> new), why it matters, how to go on."""
    what = "; ".join(f"{change} ({why})" for change, why in refused)
    keys = ",".join(change.key for change, _ in refused)
    hints = []
    old = _old_config(stored, cfg)
    if old is not None and {c.key for c, _ in refused} == {"train.steps"}:
        hints.append(f"to train on at the schedule's final learning rate instead, add "
                     f"optim.decay_steps={schedule_length(old)}")
    hints.append(f"to accept the change, add {ALLOW_KEY}=[{keys}] (or {ALLOW_KEY}=all)")
    hints.append("to start afresh, use another run.output_dir")
    return (f"run.output_dir='{cfg.run.output_dir}' resumes from step {step}, but the config changes what was "
            f"already trained (compared with {where}): {what}. To go on: " + "; ".join(hints))


def read_stored(output_dir: str, checkpoint_dir: str, step: Optional[int]) -> tuple[Optional[dict], str]:
    """(the config the run was trained with, where it was read), or (None, "") when there is none.

    The `config` of persistent checkpoint `step`'s extra (None: no persistent checkpoint) is the
    config that trained it; without one, the run's config.yaml (written at every start)."""
    if step is not None:
        path = join(checkpoint_dir, str(step), "extra", "metadata")  # Orbax's JsonCheckpointHandler file
        if small_files.is_file(path):
            config = json.loads(small_files.read_bytes(path)).get("config")
            if isinstance(config, dict):
                return config, f"checkpoint {step}"
    path = join(output_dir, "config.yaml")
    if small_files.is_file(path):
        config = yaml.safe_load(small_files.read_bytes(path))
        if isinstance(config, dict):
            return config, "the run's config.yaml"
    return None, ""


def decide(cfg: Config, checkpoint_dir: str, step: int, persistent: Optional[int]) -> dict:
    """Process 0's verdict on resuming from `step` (`persistent`: the newest persistent checkpoint):
    {"changes": [...], "consented": [...], "source": ..., "refused": the one-line message or ""}."""
    stored, where = read_stored(cfg.run.output_dir, checkpoint_dir, persistent)
    if stored is None:
        return {"changes": [], "consented": [], "source": "", "refused": ""}
    changes, refused = check_changes(stored, cfg, step)
    for c in changes:  # no consent helps: the checkpoint holds the old optimizer's state, not the new one's
        if c.key == "optim.name":
            return {"changes": [], "consented": [], "source": where, "refused": (
                f"run.output_dir='{cfg.run.output_dir}' resumes from step {step}, but optim.name changes {_show(c.old)} -> {_show(c.new)} "
                f"(compared with {where}): the checkpoint holds {_show(c.old)}'s optimizer state, which "
                f"{_show(c.new)} cannot use, and run.allow_changes cannot accept this. To go on: keep "
                f"optim.name={_show(c.old)}, or start afresh with another run.output_dir")}
    allowed = allowed_keys(cfg)
    needing = [(c, why) for c, why in refused if allowed is not None and c.key not in allowed]
    consented = [c.key for c, _ in refused if allowed is None or c.key in allowed]
    return {"changes": [{"key": c.key, "old": c.old, "new": c.new} for c in changes],
            "consented": consented,
            "source": where,
            "refused": refusal_message(needing, stored, cfg, step, where) if needing else ""}


def check_resume(cfg: Config, checkpoint_dir: str, step: int, *, persistent: Optional[int],
                 agree: Callable[[str, Callable[[], str]], str]) -> Optional[dict]:
    """On a resume from `step`: stop on a change that alters what was already trained without
    consent, else return the `config_changed` event's details (None: nothing changed).

    Collective: call it on every process, in the same order. Process 0 decides (`agree` is
    `Checkpointer.agree`); every process returns or raises the same.
    Raises:
      ConfigError: a refused change (one line: the keys, old -> new, why, how to go on).
      TransientStorageError: the stored config could not be read for now (exit 75: retry).
    """
    def verdict() -> str:
        try:
            return json.dumps(decide(cfg, checkpoint_dir, step, persistent))
        except Exception as e:  # every process raises, instead of process 0 alone
            return json.dumps({"error": f"{type(e).__name__}: {e}", "transient": object_store.is_transient(e)})

    answer = json.loads(agree("config changes", verdict))
    if "error" in answer:
        message = f"reading the config the run in '{cfg.run.output_dir}' was trained with failed: {answer['error']}"
        raise (object_store.TransientStorageError if answer["transient"] else RuntimeError)(message)
    if answer["refused"]:
        raise ConfigError(answer["refused"])
    if not answer["changes"]:
        return None
    return {"restored_step": step, "changes": answer["changes"], "consented": answer["consented"],
            "compared_with": answer["source"]}
