"""`python -m dpjax.pretrain`: non-private pretraining on a public corpus, to a
Hugging Face checkpoint that `INITIAL_CHECKPOINT_PATH` loads.

  python -m dpjax.pretrain --gin_file=gin/pretrain/msmarco_t5.gin \\
      [--output_dir=D] [--verify] [--gin.NAME=VALUE ...]

The gin file is a training gin (model, TASK_FEATURE_LENGTHS, BATCH_SIZE,
TRAIN_STEPS, optimizer, MODEL_DIR) whose task is a `tasks.pretraining` task
(T5: span corruption; GPT-2: causal LM) and which names its release with
`pretrain.output_dir`. The run is the trainer's, with every step public: the
task is its own public task under a redaction schedule of probability 1, at
ε = ∞ (no clipping, no noise, no secret in use). Batches are shuffled with
`train.seed` and the masks drawn from `register_pretraining_task.seed`, so
the same command on the same platform (jax, XLA, CPU) gives the same bits.

The release (written beside D and renamed into place, so D is whole or
untouched): `config.json` + `model.safetensors` (`dpjax.pretrained.export_hf`),
the tokenizer files under their Hugging Face names, `pretraining.json` (the
operative gin config, the corpus files' SHA-256, steps, final eval loss on the
corpus's validation split, jax version) and `SHA256SUMS` (`sha256sum -c`
format) over the weights, config and tokenizer. `--verify` rebuilds from
scratch in a temporary directory and compares with D's SHA256SUMS: exit 0 if
every file matches, 1 if not.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import gin
import jax

from dpjax import configurables, export, fileio
from dpjax.pipelines import harness
from dpjax.training import reporting, run_config
from dpjax.data.readers import SAMPLE_DATA_DIR
from tasks import pretraining  # also the gin configurables and constants

CHECKSUMS_FILE = "SHA256SUMS"
PROVENANCE_FILE = "pretraining.json"


def public_run(config: run_config.RunConfig) -> run_config.RunConfig:
  """`config` with every step a public step on its own task (no clipping, no
  noise, ε = ∞)."""
  return dataclasses.replace(
      config, target_epsilon="inf", public_task_name=config.mixture_or_task_name,
      redaction_schedule="constant", redaction_probability=1.0,
      generate_after_training=False)


def sha256(path: str) -> str:
  """The hex SHA-256 digest of the file at `path`."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def read_checksums(directory: str) -> dict[str, str]:
  """{file name: hex digest} of a release's SHA256SUMS."""
  path = os.path.join(directory, CHECKSUMS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no {CHECKSUMS_FILE} in {directory}")
  sums = {}
  with open(path) as f:
    for line in f:
      digest, _, name = line.rstrip("\n").partition("  ")
      sums[name] = digest
  return sums


def write_release(model_dir: str, out: str, tokenizer: dict[str, str],
                  provenance: dict) -> dict[str, str]:
  """The release of the run in `model_dir` into the empty directory `out`;
  returns its checksums."""
  config, params, _ = export.load_run(model_dir)
  files = export.write_params(params, config, out)
  files += export.copy_tokenizer(tokenizer, out)
  sums = {name: sha256(os.path.join(out, name)) for name in sorted(files)}
  fileio.write_atomic(os.path.join(out, CHECKSUMS_FILE), "".join(
      f"{digest}  {name}\n" for name, digest in sums.items()))
  fileio.write_atomic(os.path.join(out, PROVENANCE_FILE),
                      json.dumps(provenance, indent=2, sort_keys=True) + "\n")
  return sums


@gin.configurable(denylist=["verify"])
def pretrain(output_dir: str = gin.REQUIRED, verify: bool = False) -> dict:
  """Trains the configured public run and writes (or, with `verify`,
  rebuilds and checks) its release at `output_dir`."""
  config = public_run(configurables.run_config())
  output_dir = os.path.abspath(os.path.expanduser(output_dir))
  work = tempfile.mkdtemp(prefix="dpjax-pretrain-") if verify else None
  try:
    if work:  # from scratch, never resuming a run of the release's
      config = dataclasses.replace(config, model_dir=os.path.join(work, "run"))
      expected = read_checksums(output_dir)
    # A finished run resumes at its end and evaluates nothing.
    previous = harness.finished_summary(
        os.path.abspath(os.path.expanduser(config.model_dir))) or {}
    summary = configurables.train(config)
    summary.setdefault("eval_loss", previous.get("eval_loss"))
    source = pretraining.SOURCES[config.mixture_or_task_name]
    provenance = {
        # Shipped paths as the repository names them, not this machine.
        "gin_config": gin.operative_config_str().replace(
            SAMPLE_DATA_DIR, "tasks/data"),
        "corpus": {f: sha256(os.path.join(source.corpus_dir, f))
                   for f in sorted(os.listdir(source.corpus_dir))
                   if f.endswith(".jsonl")},
        "steps": summary["steps"], "eval_loss": summary["eval_loss"],
        "jax": jax.__version__, "backend": jax.default_backend()}
    target = os.path.join(work, "release") if work else output_dir
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.tmp-")
    try:
      sums = write_release(config.model_dir, tmp, source.tokenizer_files,
                           provenance)
      export.install(tmp, target)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    result = {"output_dir": target, "checksums": sums,
              "eval_loss": summary["eval_loss"]}
    if work:
      result["mismatched"] = sorted(
          n for n in set(sums) | set(expected) if sums.get(n) != expected.get(n))
      reporting.say(
          f"verify {output_dir}: " + ("every file matches" if not
                                      result["mismatched"] else
                                      f"MISMATCH in {result['mismatched']}"))
    else:
      reporting.say(f"pretrained checkpoint in {output_dir} "
                    f"(eval loss {summary['eval_loss']})")
    return result
  finally:
    if work:
      shutil.rmtree(work, ignore_errors=True)
