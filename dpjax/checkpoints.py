"""Orbax checkpoints of a DP run: train state plus the run's JSON metadata.

A checkpoint holds two items:
  state: TrainState (params, optimizer state incl. the noise counter, step)
  meta:  JSON with the privacy ledger, the model config, the sampler
         description and the data position (the step: batches are a pure
         function of (seed, step), so the step is the data position).
Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a crash never leaves a half-written checkpoint behind. After each
save the ledger is also written atomically to MODEL_DIR/privacy_ledger.json.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from dpjax.privacy import ledger as ledger_lib


class CheckpointMismatchError(ValueError):
  """The checkpoint in a model directory belongs to a different run setup."""


def manager(model_dir: str, *, max_to_keep: int | None = 3,
            create: bool = True) -> ocp.CheckpointManager:
  """The run's checkpoint manager; `create=False` to only read."""
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(model_dir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           create=create,
                                           enable_async_checkpointing=False),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict,
         model_dir: str) -> None:
  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state._asdict()),
                                          meta=ocp.args.JsonSave(meta)))
  mngr.wait_until_finished()
  ledger_lib.PrivacyLedger.from_json(meta["ledger"]).save(
      os.path.join(model_dir, ledger_lib.LEDGER_FILENAME))


def latest_meta(mngr: ocp.CheckpointManager) -> tuple[int, dict] | None:
  step = mngr.latest_step()
  if step is None:
    return None
  restored = mngr.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))
  return step, restored["meta"]


def restore_state(mngr: ocp.CheckpointManager, step: int, target_state) -> Any:
  """Restores a TrainState shaped and sharded like `target_state`."""
  abstract = jax_abstract(target_state._asdict())
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]
  return type(target_state)(**restored)


def restore_params(mngr: ocp.CheckpointManager, step: int,
                   sharding: jax.sharding.Sharding | None = None) -> Any:
  """Only the params of a checkpoint, placed by `sharding` (default: the
  first local device), whatever the mesh it was saved from."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  saved = mngr.item_metadata(step)["state"]
  target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
      saved)
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"]
  return restored["params"]


def jax_abstract(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      tree)


def check_compatible(saved: dict, current: dict, what: str) -> None:
  """Raises CheckpointMismatchError naming every field that differs."""
  diffs = [f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
           for k in sorted(set(saved) | set(current))
           if saved.get(k) != current.get(k)]
  if diffs:
    raise CheckpointMismatchError(
        f"the checkpoint in this model directory was written with a different "
        f"{what}:\n  " + "\n  ".join(diffs) +
        "\nUse a fresh MODEL_DIR, or restore the original configuration.")
