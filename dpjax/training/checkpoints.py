"""Orbax checkpoints of a DP run: train state plus the run's JSON metadata.

A checkpoint holds two items:
  state: TrainState (step, params, the base optimizer's state and the noise
         counter; a checkpoint that keeps the counter inside the optimizer
         state, `(PrivatizeState(count), base state)`, reads back into this
         layout too)
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

The meta is authenticated: it is saved with an HMAC-SHA256 (`MAC_FIELD`)
keyed by the run secret's `meta_key()`, and every read checks it before
using a field, so a meta edited (or copied from another run) by anything
that does not hold MODEL_DIR/secret_key.json is refused
(`TamperedCheckpointError`), never skipped for an older checkpoint. The MAC
does not protect against whoever can read the secret file: they can sign
any meta. What the meta says is checked against itself and the state by
`dpjax.verify`.

The meta is a typed record (`RunMeta`); what a run may resume from, or start
from, is decided here too: the model must be the saved one up to settings
that change only how a step computes (`check_model`), or one that extends it
(`init_from_run`: the subtrees the run lacks, e.g. a discriminator head, are
freshly initialised).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import shutil
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from dpjax.training import distributed, reporting
from dpjax import fileio
from dpjax.privacy import ledger as ledger_lib

CORRUPT_DIRNAME = "corrupt_checkpoints"
MAC_FIELD = "mac"  # the meta's HMAC-SHA256, hex, over the other fields


class CheckpointMismatchError(ValueError):
  """The checkpoint in a model directory belongs to a different run setup."""


class TamperedCheckpointError(CheckpointMismatchError):
  """A checkpoint's meta does not carry its run's MAC: edited, copied from
  another run, or written before dpjax authenticated checkpoints."""


class UnreadableCheckpointError(ValueError):
  """No checkpoint in a model directory reads back whole."""


class CheckpointSaveError(OSError):
  """A checkpoint was not saved (a fault: disk full, orbax declined)."""


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """Where the data stream of a run stands after `step` optimizer steps:
  batches are pure functions of (secret, release index), so the step and the
  split of the steps into DP releases and public steps are the position.
  `seed` is the run's public seed (dropout, redaction coins)."""
  step: int
  seed: int
  dp_steps: int
  public_steps: int = 0


@dataclasses.dataclass(frozen=True)
class RunMeta:
  """The JSON metadata saved with every checkpoint of a run.

  `ledger` is the privacy ledger's JSON (`PrivacyLedger.from_json`: the one
  source of truth for ε), `plan` the plan's guarantee (`plan.Plan`),
  `model_class`/`model_config` the model (`trainable.config_from_json`),
  `sampler` the DP sampler's description, and the task, feature lengths,
  pretrained start and tokenizer files the run was trained with.
  """
  ledger: dict
  plan: dict
  model_class: str
  model_config: dict
  data_position: DataPosition
  sampler: dict
  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  initial_checkpoint_path: str | None = None
  tokenizer_files: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def step(self) -> int:
    """The checkpoint's step (its data position's)."""
    return self.data_position.step

  def privacy_ledger(self) -> ledger_lib.PrivacyLedger:
    """The saved ledger as a `PrivacyLedger`."""
    return ledger_lib.PrivacyLedger.from_json(self.ledger)

  def to_json(self) -> dict:
    """A plain dict of the fields (JSON-serializable)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, meta: Any, step: int, key: bytes) -> "RunMeta":
    """The meta of checkpoint `step`, after checking its MAC with `key`
    (`RunSecret.meta_key()`); checkpoints from before a field was saved
    read back with its old meaning (no class: T5; no split of the steps:
    all DP; no tokenizer files: the task's own)."""
    if not isinstance(meta, dict) or "ledger" not in meta:
      raise UnreadableCheckpointError(f"checkpoint {step} has no run metadata")
    check_mac(meta, key, step)
    position = dict(meta["data_position"])
    position.setdefault("dp_steps", position["step"])
    return cls(
        ledger=meta["ledger"], plan=meta["plan"],
        model_class=meta.get("model_class") or "T5Config",
        model_config=meta["model_config"],
        data_position=DataPosition(**position), sampler=meta["sampler"],
        mixture_or_task_name=meta["mixture_or_task_name"],
        task_feature_lengths=meta["task_feature_lengths"],
        initial_checkpoint_path=meta.get("initial_checkpoint_path"),
        tokenizer_files=meta.get("tokenizer_files") or {})


def _mac(meta_json: dict, key: bytes) -> str:
  body = {k: v for k, v in meta_json.items() if k != MAC_FIELD}
  text = json.dumps(body, sort_keys=True, separators=(",", ":"))
  return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def signed(meta_json: dict, key: bytes) -> dict:
  """`meta_json` with its MAC under `key` (`RunSecret.meta_key()`)."""
  return {**meta_json, MAC_FIELD: _mac(meta_json, key)}


def check_mac(meta_json: dict, key: bytes, step: int) -> None:
  """Raises TamperedCheckpointError unless `meta_json` carries its MAC under
  `key`: one changed byte in any field (or a meta of another run) fails."""
  mac = meta_json.get(MAC_FIELD)
  if not isinstance(mac, str):
    raise TamperedCheckpointError(
        f"checkpoint {step}'s meta carries no MAC (written before dpjax "
        "authenticated its checkpoints, or stripped): its ledger cannot be "
        "trusted. Use a fresh MODEL_DIR")
  if not hmac.compare_digest(mac, _mac(meta_json, key)):
    raise TamperedCheckpointError(
        f"checkpoint {step}'s meta (ledger, plan, data position) is not what "
        "its run wrote: its MAC does not verify under the run's secret. "
        "Refusing a run whose ledger may have been edited; restore the "
        "checkpoint or use a fresh MODEL_DIR")


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


def save(mngr: ocp.CheckpointManager, step: int, state, meta: RunMeta,
         model_dir: str, key: bytes) -> None:
  """Saves checkpoint `step` with its meta signed by `key` (`RunSecret.
  meta_key()`), then the ledger file from its meta.

  A save that did not happen is an error: orbax declining to save
  (`save` returning False, e.g. a step directory already there) raises
  CheckpointSaveError, and a save that fails (a full disk) removes its
  temporary directory and raises CheckpointSaveError naming the cause.
  """
  try:
    saved = mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_saved_layout(state, legacy=False)),
        meta=ocp.args.JsonSave(signed(meta.to_json(), key))))
    mngr.wait_until_finished()
  except Exception as e:
    _remove_temporaries(mngr.directory)
    raise CheckpointSaveError(
        f"saving the checkpoint at step {step} in {mngr.directory} failed: "
        f"{first_line(e)}. Nothing after the last checkpoint was saved; "
        "once the cause is fixed, rerun the same command to resume") from e
  mngr.reload()
  if not saved or step not in mngr.all_steps():
    raise CheckpointSaveError(
        f"the checkpoint at step {step} was not saved in {mngr.directory} "
        "(orbax declined: a checkpoint of that step is already there?)")
  if distributed.is_primary():
    write_ledger(model_dir, meta.ledger)


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
  """An exception in one line: the operating system's error where there is
  one (a full disk as 'No space left on device [Errno 28]', whether raised
  as an OSError or reported inside tensorstore's message), else the type
  and first line of the message."""
  cause: BaseException | None = e
  while cause is not None:
    if isinstance(cause, OSError) and cause.strerror:
      return f"{cause.strerror} [Errno {cause.errno}]"
    cause = cause.__cause__ or cause.__context__
  code = re.search(r"os_error_code='(\d+)'", str(e))
  if code:
    return f"{os.strerror(int(code.group(1)))} [Errno {code.group(1)}]"
  lines = [l for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {(lines or [''])[0].strip()[:300]}"


def _remove_temporaries(directory) -> None:
  """Removes orbax's unfinished `*.orbax-checkpoint-tmp*` directories."""
  directory = str(directory)
  if not distributed.is_primary() or not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def read_meta(mngr: ocp.CheckpointManager, step: int, key: bytes) -> RunMeta:
  """The authenticated meta of checkpoint `step` (raises if it does not
  read back, TamperedCheckpointError if its MAC does not verify)."""
  return RunMeta.from_json(mngr.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))["meta"], step, key)


def restore_newest(mngr: ocp.CheckpointManager, target_state,
                   model_dir: str, key: bytes) -> tuple[int, Any, RunMeta]:
  """(step, state, meta) of the newest checkpoint that reads back whole.

  The state is restored into `target_state`'s shapes and shardings (any
  mesh: orbax re-shards on load). All processes agree on the step. Newer
  checkpoints that do not read back are named on the console and moved to
  MODEL_DIR/corrupt_checkpoints/, so that the steps after the restored one
  are trained and saved again; their batches and noise are the same pure
  functions of (secret, step), so the ledger saved with the restored
  checkpoint stays exact. If none reads back, raises
  UnreadableCheckpointError and moves nothing; a meta whose MAC under
  `key` fails raises TamperedCheckpointError.
  """
  unreadable: list[tuple[int, str]] = []
  for step in sorted(mngr.all_steps(), reverse=True):
    restored, reason = None, "unreadable on another host"
    try:
      legacy = _legacy_layout(mngr, step)
      restored = mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(jax_abstract(
              _saved_layout(target_state, legacy))),
          meta=ocp.args.JsonRestore()))
      meta = RunMeta.from_json(restored["meta"], step, key)
    except TamperedCheckpointError:
      raise
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
    return step, _current_layout(target_state, restored["state"], legacy), meta
  raise UnreadableCheckpointError(
      f"no checkpoint in {mngr.directory} reads back: "
      + "; ".join(f"step {s}: {r}" for s, r in unreadable))


class _LegacyNoiseState(NamedTuple):
  count: Any


def _legacy_layout(mngr: ocp.CheckpointManager, step: int) -> bool:
  """Whether checkpoint `step` keeps the noise counter inside the optimizer
  state, as dpjax did before `TrainState.noise_count`: `opt_state =
  (PrivatizeState(count), base state)`."""
  return "noise_count" not in mngr.item_metadata(step)["state"]


def _saved_layout(state, legacy: bool) -> dict:
  """`state` (a TrainState) as a dict in the layout it was saved in. A
  state without adaptive clip norms (or BandMF noise) has no `clip_norms`
  (`noise_state`) entry, as before they existed, so older checkpoints keep
  restoring."""
  saved = state._asdict()
  for optional in ("clip_norms", "noise_state"):
    if saved.get(optional, ()) is None:
      del saved[optional]
  if legacy:
    count = saved.pop("noise_count")
    saved["opt_state"] = (_LegacyNoiseState(count), saved["opt_state"])
  return saved


def _current_layout(target_state, restored: dict, legacy: bool):
  """A restored state dict as `type(target_state)`."""
  if legacy:
    noise, opt_state = restored.pop("opt_state")
    restored.update(opt_state=opt_state, noise_count=noise.count)
  return type(target_state)(**restored)


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
  return _read_state_part(mngr, step, target,
                          ocp.checkpoint_utils.construct_restore_args(target)
                          )["params"]


def read_noise_count(mngr: ocp.CheckpointManager, step: int) -> int:
  """The optimizer's noise counter in checkpoint `step` (its DP releases),
  read alone."""
  if _legacy_layout(mngr, step):
    raise TamperedCheckpointError(
        f"checkpoint {step} was written before dpjax authenticated its "
        "checkpoints (its noise counter is in the optimizer state)")
  restored = _read_state_part(  # a host array: on every process
      mngr, step, {"noise_count": 0},
      {"noise_count": ocp.RestoreArgs(restore_type=np.ndarray)})
  return int(restored["noise_count"])


def _read_state_part(mngr: ocp.CheckpointManager, step: int, target,
                     restore_args):
  """The subtree `target` of checkpoint `step`'s state, read alone (the
  saved format, as a plain pytree: nothing else is read)."""
  with ocp.CheckpointManager(
      mngr.directory, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as reader:
    return reader.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args,
                                     partial_restore=True)))["state"]


def jax_abstract(tree):
  """`tree` with each array as its `jax.ShapeDtypeStruct` (sharding kept)."""
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


# Model settings that change how a step computes, not the params: a run may
# resume, or start from another run, with a different value.
_COMPUTE_ONLY = ("remat", "scan_unrolled")


def architecture(model_json: dict) -> dict:
  """A model's JSON without `_COMPUTE_ONLY` keys, nested configs too."""
  return {k: architecture(v) if isinstance(v, dict) else v
          for k, v in model_json.items() if k not in _COMPUTE_ONLY}


def config_json(model_config) -> dict:
  """The config as a checkpoint's JSON meta reads back (tuples as lists)."""
  return json.loads(json.dumps(model_config.to_json()))


def model_json(model_config) -> dict:
  """The config's JSON with its class name: what identifies a model."""
  return {"class": type(model_config).__name__, **config_json(model_config)}


def saved_model_json(meta: RunMeta) -> dict:
  """The saved model's JSON with its class name, as `model_json` gives it."""
  return {"class": meta.model_class, **meta.model_config}


def _initialisable(model_config) -> list:
  """The config and each model config among its fields (e.g. a
  GPT2DiscConfig's `lm`): the models whose runs can initialise it."""
  parts = [getattr(model_config, f.name)
           for f in dataclasses.fields(model_config)]
  return [c for c in (model_config, *parts)
          if dataclasses.is_dataclass(c) and hasattr(c, "to_json")]


def model_and_parts(model_config) -> list[dict]:
  """The architecture of each of `_initialisable(model_config)`."""
  return [architecture(model_json(c)) for c in _initialisable(model_config)]


def with_defaults(saved: dict, model_config) -> dict:
  """`saved` (a checkpoint's model JSON) with the fields it predates at
  their defaults in `model_config`'s class, nested configs too: a run
  written before a field existed (e.g. `T5Config.scan_layers`) is a run at
  its default."""
  try:
    defaults = config_json(type(model_config)())
  except TypeError:  # a config class without defaults for every field
    return saved

  def merge(default, value):
    if isinstance(default, dict) and isinstance(value, dict):
      return {**default, **{k: merge(default.get(k), v) for k, v in value.items()}}
    return value

  return merge(defaults, saved)


def check_model(meta: RunMeta, model_config) -> None:
  """Refuses to resume a checkpoint of another model (compute-only settings
  such as remat may differ)."""
  check_compatible(architecture(with_defaults(meta.model_config, model_config)),
                   architecture(config_json(model_config)), "model")


def check_initialises(meta: RunMeta, model_config) -> None:
  """Refuses a run as INITIAL_CHECKPOINT_PATH unless its model is this one
  or one this model extends (a field of its config)."""
  same_class = next((c for c in _initialisable(model_config)
                     if type(c).__name__ == meta.model_class), None)
  saved = saved_model_json(meta)
  if same_class is not None:
    saved = {"class": meta.model_class,
             **with_defaults(meta.model_config, same_class)}
  saved = architecture(saved)
  if saved not in model_and_parts(model_config):
    check_compatible(
        saved, architecture(model_json(model_config)), "model",
        source="the run in INITIAL_CHECKPOINT_PATH",
        fix="Configure the model it was trained with (or one that extends "
            "it, e.g. GPT2DiscConfig.lm = that model).")


def init_from_run(model, mngr: ocp.CheckpointManager, step: int, shardings,
                  seed: int):
  """The params of checkpoint `step` of a run, placed by `shardings` (a
  params-shaped tree): every top-level subtree the checkpoint holds is read
  back; those it lacks (the head of a model extending the run's) are
  `model.init_params(PRNGKey(seed))`'s, computed alone (jit drops the rest
  of the init) and named on the console."""
  saved = mngr.item_metadata(step)["state"]["params"]
  extra = sorted(set(saved) - set(shardings))
  if extra:
    raise CheckpointMismatchError(
        f"the run in INITIAL_CHECKPOINT_PATH has params {extra} this model "
        "does not have")
  params = restore_params(mngr, step, {k: shardings[k] for k in saved})
  missing = [k for k in shardings if k not in saved]
  if missing:
    params.update(jax.jit(
        lambda: {k: model.init_params(jax.random.PRNGKey(seed))[0][k]
                 for k in missing},
        out_shardings={k: shardings[k] for k in missing})())
    reporting.say(f"{missing}: not in the run's checkpoint, freshly "
                  f"initialised (seed {seed})")
  return params
