"""`python -m dpjax.export`: the release of a trained run, and nothing else.

  python -m dpjax.export --model_dir=D --output_dir=R [--overwrite]
      [--adapters_only [--base_model=NAME]] [--audit=A]

What is released (a whitelist: every file is written here from values read one
by one; the run directory is never copied):
  config.json + model.safetensors  the final params in Hugging Face layout
                      (T5, GPT-2, BERT: `dpjax.pretrained.export_hf`), which
                      `dpjax.pretrained.load_pretrained` and transformers read;
                      a LoRA model merged into its base model's layout;
  adapter_config.json + adapter_model.safetensors  instead, with
                      --adapters_only: a LoRA model's adapters alone in PEFT's
                      layout (`dpjax.pretrained.peft`), read by PEFT and by
                      `load_pretrained` with the base model they name: its
                      hub name (the base's config.json `_name_or_path`),
                      else its directory's name, or --base_model=NAME; never
                      a local path. base_model.json beside them records that
                      name, the sha256 of the base's weight files and both
                      vocabulary sizes; a vocabulary grown past the base's
                      (GPT-2) is carried as PEFT carries resized embeddings
                      (the whole table, tied head too). Refused for a run
                      without a Hugging Face INITIAL_CHECKPOINT_PATH, or one
                      that also trained norms and biases;
  params.safetensors  instead, for a model without a Hugging Face mapping
                      (dual encoder, GPT-2 + head): the params flattened to
                      '/'-joined dpjax names;
  dpjax_config.json   the dpjax model class and config, seed fields dropped;
  spiece.model | vocab.json + merges.txt | vocab.txt  the tokenizer files the
                      run recorded (checkpoint meta), under the names
                      `pretrained.tokenizer_files` finds, so R can be an
                      INITIAL_CHECKPOINT_PATH;
  privacy_statement.json + PRIVACY.md  the guarantee: ε recomputed from the
                      ledger's events (never a stored number), δ, accountant,
                      unit of privacy and adjacency, q, σ, C, n, DP steps,
                      sampling, target ε, model step, how the noise key was
                      drawn, and the events themselves; with --audit=A, the
                      audit in A (`python -m dpjax.audit --output_dir=A`):
                      what was audited, the threat model, the ε lower bound
                      recomputed from A's scores and its confidence
                      (`dpjax.audit.evidence`; refused if A audited another
                      mechanism or its bound exceeds ε).

What is not: the checkpoint meta, config.gin, train_summary.json, summaries,
the ledger file, optimizer state, the run secret (`secret_key.json`: the
key of the noise and the sampling, which the guarantee assumes unknown), any
seed (train.seed, a pinned secret seed, group seeds), anything else in
MODEL_DIR.

Refused with exit status 2 and one line, before anything is written: D holds
no readable checkpoint, or its newest fails verification (`dpjax.verify`: an
edited or unauthenticated ledger, plan or data position, or one that does
not account for the releases its state made); R exists and is not empty
(without --overwrite), or is not an earlier dpjax release (with it: a run
directory, anything else); R is D or lies inside it (or holds it). The
release is written into a temporary directory beside R and renamed into
place at the end: R is either the whole release or untouched.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import jax
import numpy as np
from flax import traverse_util

from dpjax.training import checkpoints
from dpjax import errors, fileio, gin_cli, pretrained
from dpjax.audit import evidence
from dpjax.generation import inference
from dpjax.models import dual_encoder
from dpjax.privacy import ledger as ledger_lib, mechanisms
from dpjax.privacy import secret as secret_lib

STATEMENT_FILE = "privacy_statement.json"
STATEMENT_MD = "PRIVACY.md"
CONFIG_FILE = "dpjax_config.json"
FLAT_PARAMS_FILE = "params.safetensors"
# Tokenizer kinds (`pretrained.tokenizer_files`) -> the names they are released
# under, the Hugging Face ones.
TOKENIZER_NAMES = {"sentencepiece": "spiece.model", "vocab": "vocab.json",
                   "merges": "merges.txt", "wordpiece": "vocab.txt"}
# The sampler's `describe()` keys a statement repeats (never a seed).
_SAMPLING_KEYS = ("method", "sampling_rate", "expected_batch_size",
                  "max_batch_size", "batch_size", "steps_per_epoch",
                  "max_examples_per_user")
NOISE_KEY_ORIGINS = ("os_entropy", "pinned")
# Every file a release may hold: what --overwrite may replace.
RELEASE_FILES = frozenset({
    STATEMENT_FILE, STATEMENT_MD, CONFIG_FILE, FLAT_PARAMS_FILE,
    pretrained.hf.CONFIG_FILE, pretrained.hf.SAFETENSORS_FILE,
    pretrained.peft.ADAPTER_CONFIG, pretrained.peft.ADAPTER_WEIGHTS,
    pretrained.peft.BASE_MODEL_FILE,
    *TOKENIZER_NAMES.values()})


def _float(x: float) -> float | str:
  return x if math.isfinite(x) else str(x)  # strict JSON has no infinity


def _inside(path: str, directory: str) -> bool:
  return os.path.commonpath([path, directory]) == directory


def check_paths(model_dir: str, output_dir: str, overwrite: bool) -> None:
  """Raises UsageError if R may not receive the release of D."""
  d, r = os.path.realpath(model_dir), os.path.realpath(output_dir)
  if _inside(r, d) or _inside(d, r):
    raise errors.UsageError(f"--output_dir {output_dir} must lie outside "
                             f"--model_dir {model_dir} (and not hold it)")
  if os.path.exists(r) and not os.path.isdir(r):
    raise errors.UsageError(f"--output_dir {output_dir} is a file")
  if not os.path.isdir(r) or not os.listdir(r):
    return
  if not overwrite:
    raise errors.UsageError(f"--output_dir {output_dir} is not empty; pass "
                             "--overwrite to replace it")
  names = sorted(os.listdir(r))
  if "checkpoints" in names or secret_lib.SECRET_FILENAME in names:
    raise errors.UsageError(
        f"--output_dir {output_dir} holds a dpjax run (checkpoints/ or "
        f"{secret_lib.SECRET_FILENAME}); --overwrite replaces only an earlier "
        "release")
  foreign = [n for n in names if n not in RELEASE_FILES
             or not os.path.isfile(os.path.join(r, n))]
  if foreign or STATEMENT_FILE not in names:
    raise errors.UsageError(
        f"--output_dir {output_dir} is not an earlier dpjax release (it holds "
        f"{', '.join(foreign[:5]) or f'no {STATEMENT_FILE}'}); --overwrite "
        "replaces only a release")


def load_run(model_dir: str):
  """(config, params as numpy, meta) of D's newest readable checkpoint."""
  try:
    config, params, meta = inference.load_trained(model_dir)
  except (FileNotFoundError, checkpoints.UnreadableCheckpointError,
          checkpoints.CheckpointMismatchError) as e:
    raise errors.UsageError(" ".join(str(e).split())) from None
  return config, jax.device_get(params), meta


def public_config(config_json: dict) -> dict:
  """A model config's JSON without its seed fields, nested configs too."""
  return {k: public_config(v) if isinstance(v, dict) else v
          for k, v in config_json.items() if "seed" not in k.lower()}


def noise_key_origin(ledger_json: dict) -> str:
  """'os_entropy', 'pinned' (by the user), or 'unknown' (not recorded)."""
  origin = ledger_json.get("secret")
  return origin if origin in NOISE_KEY_ORIGINS else "unknown"


def unit_and_adjacency(ledger_json: dict, config, redaction: dict | None
                       ) -> tuple[str, str]:
  """What one neighbouring dataset changes, and how; the ledger's own
  `unit`/`adjacency` fields win."""
  sampling = ledger_json["sampling"]
  method = sampling.get("method")
  adjacency = (ledger_json.get("adjacency") or sampling.get("adjacency") or
               {"poisson": "add_or_remove_one",
                "shuffle": "replace_one"}.get(method, "unknown"))
  if isinstance(config, dual_encoder.DualEncoderConfig):
    unit = ("one (query, passage) pair" if method == "shuffle" else
            f"one training row: a group of {config.group_size} (query, "
            "passage) pairs (no pair-level guarantee under Poisson sampling)")
  elif method == "user_poisson":
    unit = ("one user: all of a user's examples (each sampled user's "
            f"{sampling.get('max_examples_per_user')} or fewer examples "
            "averaged after clipping)")
  else:
    unit = "one training example"
  if redaction:
    unit = (f"selective DP for the redaction policy of "
            f"{redaction.get('public_task')!r}: neighbours differ only in "
            "tokens the policy redacts (not example-level DP)")
  return ledger_json.get("unit") or unit, adjacency


def privacy_statement(meta: checkpoints.RunMeta, config) -> dict:
  """The privacy statement of a checkpoint's meta; ε recomputed from the
  ledger's events. Reads only the fields it names."""
  ledger_json = meta.ledger
  ledger = ledger_lib.PrivacyLedger.from_json(ledger_json)
  plan = meta.plan
  mechanism = mechanisms.from_plan(plan)
  redaction = plan.get("redaction")
  unit, adjacency = unit_and_adjacency(ledger_json, config, redaction)
  origin = noise_key_origin(ledger_json)
  return {
      "epsilon": _float(ledger.epsilon_spent()),
      "delta": ledger.delta,
      "accountant": ledger.accountant,
      "unit_of_privacy": unit,
      "adjacency": adjacency,
      "sampling": {k: ledger.sampling[k] for k in _SAMPLING_KEYS
                   if k in ledger.sampling},
      "sampling_rate": ledger.sampling.get("sampling_rate"),
      "noise_multiplier": ledger.noise_multiplier,
      "clip_norm": ledger.clip_norm,
      "clip_norms": plan.get("clip_norms"),
      "clipping": mechanism.describe_clipping(ledger.clip_norm,
                                              plan.get("clip_norms")),
      "mechanism": ledger.mechanism,
      "mechanism_description": mechanism.describe_noise(),
      "dataset_size": ledger.dataset_size,
      "dp_steps": ledger.steps,
      "target_epsilon": _float(ledger.target_epsilon),
      "model_step": int(meta.step),
      "public_steps": (redaction or {}).get("public_steps", 0),
      "noise_key": origin,
      "guarantee_excludes": ("whoever pinned the noise key"
                             if origin == "pinned" else None),
      "events": [e.to_json() for e in ledger.events],
      "prior_events": [e.to_json() for e in ledger.prior_events],
      "model_class": type(config).__name__,
      "task": meta.mixture_or_task_name,
  }


_NOISE_KEY_TEXT = {
    "os_entropy": "The noise key was drawn from OS entropy and is in no "
                  "released file.",
    "pinned": "**WARNING: the noise key was pinned by the user** "
              "(train.pinned_secret_seed). Whoever pinned it knows the noise "
              "added to every release and the batches, and can remove the "
              "noise: the guarantee below does NOT hold against them.",
    "unknown": "**WARNING: the run did not record how its noise key was "
               "drawn.** If it came from a seed in the run's configuration, "
               "whoever knows that seed knows the noise, and the guarantee "
               "does not hold against them.",
}


def privacy_markdown(s: dict) -> str:
  """PRIVACY.md: the statement for people."""
  rows = [("ε spent (recomputed from the ledger's events)", s["epsilon"]),
          ("δ", s["delta"]), ("accountant", s["accountant"]),
          ("unit of privacy", s["unit_of_privacy"]),
          ("adjacency", s["adjacency"]),
          ("sampling", s["sampling"].get("method")),
          ("q (sampling rate)", s["sampling_rate"]),
          ("σ (noise multiplier)", s["noise_multiplier"]),
          ("C (clip norm)", s["clipping"]),
          ("n (dataset size)", s["dataset_size"]),
          ("DP steps", s["dp_steps"]), ("target ε", s["target_epsilon"]),
          ("model step", s["model_step"]), ("noise key", s["noise_key"])]
  eps = s["epsilon"]
  eps = f"{eps:.4g}" if isinstance(eps, float) else eps
  lines = ["# Privacy statement", "", _NOISE_KEY_TEXT[s["noise_key"]], "",
           f"These parameters were trained by dpjax with "
           f"{s['mechanism_description']} and are "
           f"(ε = {eps}, δ = {s['delta']:.3g})-differentially private for "
           f"{s['unit_of_privacy']} under {s['adjacency']} adjacency "
           f"({s['accountant']} accounting), provided the run's secret key "
           "(of its noise and sampling) stays private.", ""]
  if s["public_steps"]:
    lines += [f"{s['public_steps']} of the {s['model_step']} steps were "
              "non-private steps on redacted data, assumed public.", ""]
  if s["prior_events"]:
    lines += ["ε includes the releases of earlier runs on the same data "
              "(`prior_events`).", ""]
  lines += fileio.markdown_table(["quantity", "value"],
                                 [(k, str(v)) for k, v in rows])
  lines += ["", "Anything computed from this release alone (generated text, "
            "embeddings, further training on public data) keeps the "
            f"guarantee. The events behind ε are in {STATEMENT_FILE}."]
  if s.get("audit"):
    lines += [""] + evidence.markdown(s["audit"], s["epsilon"])
  return "\n".join(lines) + "\n"


def adapter_base(config, initial_checkpoint_path: str | None,
                 base_model: str | None = None) -> dict:
  """The base record (`peft.describe_base`) an adapters-only release of a
  run started from `initial_checkpoint_path` names; UsageError if the run
  cannot be released so (checked before anything is written)."""
  cfg = getattr(config, "lora", None)
  if cfg is None:
    raise errors.UsageError("--adapters_only: the model has no LoRA adapters")
  if cfg.train != "lora_only":
    raise errors.UsageError(
        f"--adapters_only: LoRAConfig.train = {cfg.train!r} also trained the "
        "norms and biases, which PEFT's LoRA file does not hold; export the "
        "merged model")
  if not initial_checkpoint_path:
    raise errors.UsageError(
        "--adapters_only: the run has no INITIAL_CHECKPOINT_PATH, so no base "
        "model the adapters could be loaded onto; export the merged model")
  if pretrained.peft.is_adapter_dir(initial_checkpoint_path):
    raise errors.UsageError(
        f"--adapters_only: the run started from the adapter release "
        f"{initial_checkpoint_path}, not a base model; export the merged model")
  try:
    base = pretrained.peft.describe_base(initial_checkpoint_path, base_model)
    pretrained.peft.carried_embeddings(config, base)  # a vocabulary it cannot carry
  except (pretrained.CheckpointError, OSError) as e:
    raise errors.UsageError(f"--adapters_only: {' '.join(str(e).split())}"
                            ) from None
  return base


def write_params(params, config, out: str, *, adapters_only: bool = False,
                 base: dict | None = None) -> list[str]:
  """The params as Hugging Face files, else as flattened safetensors; with
  `adapters_only`, a LoRA model's adapters as a PEFT directory on `base`
  (`adapter_base`)."""
  if adapters_only:
    return pretrained.peft.export_adapters(params, config, out, base=base)
  try:
    pretrained.hf.mapping_for(config)
  except pretrained.CheckpointError:
    from safetensors import numpy as st_numpy
    flat = traverse_util.flatten_dict(params, sep="/")
    st_numpy.save_file({k: np.ascontiguousarray(v) for k, v in flat.items()},
                       os.path.join(out, FLAT_PARAMS_FILE))
    return [FLAT_PARAMS_FILE]
  pretrained.export_hf(params, config, out)
  return [pretrained.hf.CONFIG_FILE, pretrained.hf.SAFETENSORS_FILE]


def copy_tokenizer(files: dict, out: str) -> list[str]:
  """Copies the recorded tokenizer files under their Hugging Face names."""
  unknown = sorted(set(files) - set(TOKENIZER_NAMES))
  if unknown:
    raise errors.UsageError(f"unknown tokenizer file kinds {unknown}; "
                             f"known: {sorted(TOKENIZER_NAMES)}")
  for kind, path in files.items():
    if not os.path.isfile(path):
      raise errors.UsageError(f"the run's {kind} tokenizer file {path} is "
                               "missing")
    shutil.copyfile(path, os.path.join(out, TOKENIZER_NAMES[kind]))
  return sorted(TOKENIZER_NAMES[k] for k in files)


def install(tmp: str, output_dir: str) -> None:
  """Renames the finished `tmp` to `output_dir`, replacing what was there."""
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    old = tempfile.mkdtemp(dir=os.path.dirname(output_dir),
                           prefix=f".{os.path.basename(output_dir)}.old-")
    os.replace(output_dir, old)
    os.replace(tmp, output_dir)
    shutil.rmtree(old)
  else:
    os.replace(tmp, output_dir)  # over an empty directory too (POSIX)


def export_run(model_dir: str, output_dir: str, *, overwrite: bool = False,
               adapters_only: bool = False, audit_dir: str | None = None,
               base_model: str | None = None) -> dict:
  """Writes the release of the run in `model_dir` to `output_dir`; returns
  its path, files and statement. `adapters_only`: a LoRA run's adapters in
  PEFT's layout instead of the merged model, their base named `base_model`
  (default: `peft.describe_base`'s name). `audit_dir`: an audit of this
  run's mechanism, stated beside ε (`dpjax.audit.evidence`)."""
  model_dir, output_dir = (os.path.abspath(os.path.expanduser(p))
                           for p in (model_dir, output_dir))
  check_paths(model_dir, output_dir, overwrite)
  if base_model is not None and not adapters_only:
    raise errors.UsageError("--base_model names the base of --adapters_only")
  config, params, meta = load_run(model_dir)
  base = (adapter_base(config, meta.initial_checkpoint_path, base_model)
          if adapters_only else None)
  statement = privacy_statement(meta, config)
  statement["audit"] = None if audit_dir is None else (
      evidence.statement_entry(os.path.abspath(os.path.expanduser(audit_dir)),
                               meta.privacy_ledger(), model_dir))
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent,
                         prefix=f".{os.path.basename(output_dir)}.tmp-")
  try:
    files = write_params(params, config, tmp, adapters_only=adapters_only,
                         base=base)
    files += copy_tokenizer(meta.tokenizer_files, tmp)
    released = {"model_class": type(config).__name__,
                "model_config": public_config(config.to_json())}
    for name, text in (
        (CONFIG_FILE, json.dumps(released, indent=2, sort_keys=True) + "\n"),
        (STATEMENT_FILE, json.dumps(statement, indent=2, allow_nan=False)
         + "\n"),
        (STATEMENT_MD, privacy_markdown(statement))):
      fileio.write_atomic(os.path.join(tmp, name), text)
      files.append(name)
    install(tmp, output_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {"output_dir": output_dir, "files": sorted(files),
          "statement": statement}


def main(argv=None) -> dict:
  """Runs `python -m dpjax.export`; returns `export_run`'s result."""
  parser = argparse.ArgumentParser(
      prog="python -m dpjax.export",
      description="Write the release of a trained run: final params, model "
                  "config, tokenizer files and its privacy statement.")
  parser.add_argument("--model_dir", required=True)
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty --output_dir")
  parser.add_argument("--adapters_only", action="store_true",
                      help="a LoRA run: its adapters alone, in PEFT's layout "
                           "(adapter_config.json + adapter_model.safetensors), "
                           "instead of the merged model")
  parser.add_argument("--base_model", metavar="NAME", default=None,
                      help="with --adapters_only: the name the adapters give "
                           "their base model (a hub id or a plain name; "
                           "default: the base checkpoint's hub name, else its "
                           "directory's name)")
  parser.add_argument("--audit", metavar="A", default=None,
                      help="the output directory of `python -m dpjax.audit` "
                           "on this run's configuration: its ε lower bound "
                           "goes into PRIVACY.md and privacy_statement.json")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  result = export_run(args.model_dir, args.output_dir,
                      overwrite=args.overwrite,
                      adapters_only=args.adapters_only, audit_dir=args.audit,
                      base_model=args.base_model)
  s = result["statement"]
  audited = ("" if s["audit"] is None else
             f"; audited ε ≥ {s['audit']['epsilon_lower_bound']:.3g}")
  print(f"dpjax: released {args.model_dir} (step {s['model_step']}) to "
        f"{result['output_dir']}: ε = {s['epsilon']} at "
        f"δ = {s['delta']:.3g}, noise key {s['noise_key']}{audited}",
        flush=True)
  return result


if __name__ == "__main__":
  gin_cli.run_command(main)
