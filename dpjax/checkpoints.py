"""Orbax checkpoints of a DP run: train state plus the run's JSON metadata.

A checkpoint holds two items:
  state: TrainState (params, optimizer state incl. the noise counter, step)
  meta:  JSON with the privacy ledger, the model config, the sampler
         description and the data position (the step: batches are a pure
         function of (secret, step), so the step is the data position; with
         a redaction schedule also the DP and public steps before it, which
         the schedule's public coins recompute from (seed, step)). The run
         secret is never in a checkpoint: it is MODEL_DIR/secret_key.json.
Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a crash never leaves a half-written checkpoint behind. After each
save the ledger is also written atomically to MODEL_DIR/privacy_ledger.json: a
copy of the ledger in the newest checkpoint's meta.

Multi-host: every process saves and restores its own shards (MODEL_DIR must
be on a filesystem all hosts share, e.g. GCS or NFS); the meta JSON and the
ledger file are written by process 0 alone.

A checkpoint that no longer reads back (truncated or missing files) is skipped
on resume for the newest one that does, and said so (`restore_newest`).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp

from dpjax import distributed, fileio, reporting
from dpjax.privacy import ledger as ledger_lib

CORRUPT_DIRNAME = "corrupt_checkpoints"


class CheckpointMismatchError(ValueError):
  """The checkpoint in a model directory belongs to a different run setup."""


class UnreadableCheckpointError(ValueError):
  """No checkpoint in a model directory reads back whole."""


class CheckpointSaveError(OSError):
  """A checkpoint was not saved (a fault: disk full, orbax declined)."""


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
  """Saves checkpoint `step`, then the ledger file from its meta.

  A save that did not happen is an error: orbax declining to save
  (`save` returning False, e.g. a step directory already there) raises
  CheckpointSaveError, and a save that fails (a full disk) removes its
  temporary directory and raises CheckpointSaveError naming the cause.
  """
  try:
    saved = mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state._asdict()),
        meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()
  except Exception as e:
    _remove_temporaries(mngr.directory)
    raise CheckpointSaveError(
        f"saving the checkpoint at step {step} in {mngr.directory} failed: "
        f"{first_line(e)}") from e
  mngr.reload()
  if not saved or step not in mngr.all_steps():
    raise CheckpointSaveError(
        f"the checkpoint at step {step} was not saved in {mngr.directory} "
        "(orbax declined: a checkpoint of that step is already there?)")
  if distributed.is_primary():
    write_ledger(model_dir, meta["ledger"])


def write_ledger(model_dir: str, ledger_json: dict) -> bool:
  """Writes MODEL_DIR/privacy_ledger.json from a checkpoint's ledger
  (atomically); True if the file said something else before (missing,
  truncated, edited, or behind after a crash between checkpoint and file)."""
  path = os.path.join(model_dir, ledger_lib.LEDGER_FILENAME)
  text = json.dumps(ledger_json, indent=2, allow_nan=False)
  try:
    with open(path) as f:
      stale = f.read() != text
  except FileNotFoundError:
    stale = False
  except (OSError, UnicodeDecodeError):
    stale = True
  fileio.write_atomic(path, text)
  return stale


def first_line(e: BaseException) -> str:
  """An exception in one line (a full disk's cause first)."""
  lines = [l for l in str(e).splitlines() if l.strip()]
  no_space = [l for l in lines if "No space left" in l]
  return f"{type(e).__name__}: {(no_space or lines or [''])[0].strip()[:300]}"


def _remove_temporaries(directory) -> None:
  """Removes orbax's unfinished `*.orbax-checkpoint-tmp*` directories."""
  directory = str(directory)
  if not distributed.is_primary() or not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _checked_meta(meta, step: int) -> dict:
  if not isinstance(meta, dict) or "ledger" not in meta:
    raise UnreadableCheckpointError(f"checkpoint {step} has no run metadata")
  return meta


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
  """The JSON meta of checkpoint `step` (raises if it does not read back)."""
  return _checked_meta(mngr.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))["meta"], step)


def latest_meta(mngr: ocp.CheckpointManager) -> tuple[int, dict] | None:
  """(step, meta) of the newest checkpoint whose meta reads back; None if
  there is no checkpoint. Checkpoints none of whose metas reads back raise
  UnreadableCheckpointError: a run is never silently started over them."""
  unreadable = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      return step, read_meta(mngr, step)
    except Exception as e:  # unreadable: `restore_newest` reports it
      unreadable.append(f"step {step}: {first_line(e)}")
  if unreadable:
    raise UnreadableCheckpointError(
        f"no checkpoint in {mngr.directory} reads back ("
        + "; ".join(unreadable) + "). Move that directory aside to start "
        "over, or use a fresh MODEL_DIR")
  return None


def restore_newest(mngr: ocp.CheckpointManager, target_state,
                   model_dir: str) -> tuple[int, Any, dict]:
  """(step, state, meta) of the newest checkpoint that reads back whole.

  The state is restored into `target_state`'s shapes and shardings (any
  mesh: orbax re-shards on load). All processes agree on the step. Newer
  checkpoints that do not read back are named on the console and moved to
  MODEL_DIR/corrupt_checkpoints/, so that the steps after the restored one
  are trained and saved again; their batches and noise are the same pure
  functions of (secret, step), so the ledger saved with the restored
  checkpoint stays exact. If none reads back, raises
  UnreadableCheckpointError and moves nothing.
  """
  args = ocp.args.Composite(
      state=ocp.args.StandardRestore(jax_abstract(target_state._asdict())),
      meta=ocp.args.JsonRestore())
  unreadable: list[tuple[int, str]] = []
  for step in sorted(mngr.all_steps(), reverse=True):
    restored, reason = None, "unreadable on another host"
    try:
      restored = mngr.restore(step, args=args)
      _checked_meta(restored["meta"], step)
    except Exception as e:  # any unreadable file: try the previous checkpoint
      restored = None
      reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if not distributed.all_processes(restored is not None).all():
      unreadable.append((step, reason))
      continue
    if unreadable:
      _move_aside(mngr, [s for s, _ in unreadable], model_dir)
      for bad, why in unreadable:
        reporting.say(f"checkpoint at step {bad} is unreadable ({why}); "
                      f"moved to {os.path.join(model_dir, CORRUPT_DIRNAME)}")
      reporting.say(f"resuming from the previous checkpoint, step {step} "
                    f"(not {unreadable[0][0]}), with the privacy ledger "
                    "saved with it")
    return step, type(target_state)(**restored["state"]), restored["meta"]
  raise UnreadableCheckpointError(
      f"no checkpoint in {mngr.directory} reads back: "
      + "; ".join(f"step {s}: {r}" for s, r in unreadable))


def _move_aside(mngr: ocp.CheckpointManager, steps: list[int],
                model_dir: str) -> None:
  if distributed.is_primary():
    corrupt = os.path.join(model_dir, CORRUPT_DIRNAME)
    os.makedirs(corrupt, exist_ok=True)
    for step in steps:
      dest = os.path.join(corrupt, str(step))
      suffix = 0
      while os.path.exists(dest):
        suffix += 1
        dest = os.path.join(corrupt, f"{step}.{suffix}")
      shutil.move(os.path.join(mngr.directory, str(step)), dest)
  distributed.sync("dpjax_checkpoints_moved_aside")
  mngr.reload()


def restore_params(mngr: ocp.CheckpointManager, step: int,
                   sharding: Any = None) -> Any:
  """Only the params of a checkpoint (the optimizer state is not read),
  placed by `sharding`: one `Sharding` for every leaf or a params-shaped tree
  of them (default: the first local device), whatever the mesh it was saved
  from."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  saved = mngr.item_metadata(step)["state"]["params"]
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree.map(lambda _: sharding, saved)
  target = {"params": jax.tree.map(
      lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh),
      saved, sharding)}
  with ocp.CheckpointManager(  # the saved format, read as a plain pytree
      mngr.directory, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as reader:
    return reader.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target, ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))["state"]["params"]


def run_ledger(model_dir: str) -> ledger_lib.PrivacyLedger:
  """The privacy ledger of a run: its newest readable checkpoint's (the one
  source of truth; `privacy_ledger.json` is a copy), ε recomputed from its
  events."""
  found = read_run(model_dir)
  if found is None:
    raise UnreadableCheckpointError(f"{model_dir} holds no checkpoints/")
  found[0].close()
  return ledger_lib.PrivacyLedger.from_json(found[2]["ledger"])


def read_run(path: str) -> tuple[ocp.CheckpointManager, int, dict] | None:
  """(manager, step, meta) of the newest readable checkpoint of the dpjax run
  directory `path`, or None if `path` holds no `checkpoints/` (e.g. a
  Hugging Face directory); the caller closes the manager. A run directory
  none of whose checkpoints reads back raises UnreadableCheckpointError."""
  if not os.path.isdir(os.path.join(path, "checkpoints")):
    return None
  mngr = manager(path, create=False)
  found = latest_meta(mngr)
  if found is None:
    raise UnreadableCheckpointError(f"{path}/checkpoints holds no checkpoint")
  return mngr, *found


def jax_abstract(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      tree)


def check_compatible(
    saved: dict, current: dict, what: str, *,
    source: str = "the checkpoint in this model directory",
    fix: str = "Use a fresh MODEL_DIR, or restore the original configuration."
) -> None:
  """Raises CheckpointMismatchError naming every field that differs."""
  diffs = [f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
           for k in sorted(set(saved) | set(current))
           if saved.get(k) != current.get(k)]
  if diffs:
    raise CheckpointMismatchError(
        f"{source} was written with a different {what}:\n  "
        + "\n  ".join(diffs) + "\n" + fix)
