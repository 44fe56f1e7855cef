"""Table 1 and Table 4 of "DP Conditional Text Generation for Synthetic
Data" (shared/papers/002), one function each, on run directories.

* `table4`: LM test loss at each ε, naive vs multitask. Naive = a plain
  GPT-2 DP-trained on the conditional task (one release per step);
  multitask = the GPT-2 + discriminator head (`gpt2_disc`: two releases per
  step, both in the ledger), same data, steps and (ε, δ). The loss is the
  LM's mean per-example loss on the held-out split (the text tokens; the
  `BOS label SEP` prompt is masked out in both).
* `table1`: downstream accuracy at each ε. The multitask run (shared with
  Table 4) generates, per class, as many labelled texts as the training set
  holds, by PPLM-steered nucleus sampling from `BOS label SEP`
  (`pplm.pplm_generate_causal`, steered by the run's own head); a BERT
  classifier (`text_classifier`, the same settings for every row) trained on
  them is scored on the real held-out split. Also: the "original data" row
  (the classifier on the real training texts), Baseline 1 (plain conditional
  nucleus sampling, kept where the run's discriminator gives p(a|x) > 0.5),
  and the n-gram memorisation rate of the PPLM texts (n = 3..7).

Everything is resumable: finished trainings (a `train_summary.json` at the
planned step) are reused, a row already in `results.jsonl` is not redone,
and the tables are rewritten from `results.jsonl` each time. `Settings`
holds the generation and classifier settings; its defaults fit the embedded
SST-2 sample (tiny models, a 2-core CPU).

Formal guarantees: the synthetic texts, the classifiers trained on them and
their accuracies are post-processing of the DP-trained params and carry the
run's (ε, δ) (`privacy_ledger.json` in each run directory). The "original"
row, the test losses and accuracies on held-out data and the memorisation
rate read real data without DP: they are evaluation numbers, not releases.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from typing import Sequence

import gin
import jax
import numpy as np
import tokenizers

from dpjax import checkpoints, fileio, gin_cli, pplm, text_classifier, trainer
from dpjax.eval import text_quality
from dpjax.models import bert, trainable
from tasks import textcls

EPSILONS = (3.0, 8.0, 16.0, 256.0, math.inf)
KINDS = ("naive", "multitask")
DEFAULT_GIN_FILES = ("textcls_sample.gin",)
RESULTS = "results.jsonl"


@dataclasses.dataclass(frozen=True)
class Settings:
  """Generation and downstream-classifier settings (the same for every ε)."""
  dataset: str = "sst2"
  seed: int = 0
  # PPLM (PPLM's defaults but the step size) and nucleus sampling.
  step_size: float = 0.04
  num_iterations: int = 3
  kl_scale: float = 0.01
  gm_scale: float = 0.9
  top_p: float = 0.9
  max_new_tokens: int = 32
  generation_batch: int = 200
  samples_per_class: int | None = None  # None: as many as the training set
  # Downstream classifier (paper Table 5: batch 32, 5 epochs, lr decay; a
  # tiny BERT from scratch needs a larger lr than 1e-4).
  classifier_layers: int = 2
  classifier_width: int = 64
  classifier_max_tokens: int = 48
  classifier_batch: int = 32
  classifier_epochs: float = 5.0
  classifier_lr: float = 1e-3
  ngram_orders: tuple[int, ...] = (3, 4, 5, 6, 7)


def eps_name(eps: float) -> str:
  return "inf" if math.isinf(eps) else f"{eps:g}"


# ----------------------------------------------------------------------------
# Runs.
# ----------------------------------------------------------------------------


def run_dir(out_dir: str, kind: str, eps: float) -> str:
  return os.path.join(out_dir, "runs", f"{kind}_eps{eps_name(eps)}")


def _finished(model_dir: str) -> dict | None:
  path = os.path.join(model_dir, "train_summary.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  return summary if summary.get("steps_done") == summary.get("steps") else None


def train_run(out_dir: str, kind: str, eps: float, *,
              gin_files: Sequence[str] = DEFAULT_GIN_FILES,
              bindings: Sequence[str] = ()) -> dict:
  """The train summary of run (`kind`, ε), trained (or resumed) unless it has
  finished. Naive: the gin's GPT-2 alone (`train.model_config =
  @GPT2Config()`), one release per step; multitask: the gin's GPT2DiscConfig.
  The LM test loss is evaluated once, at the end (`eval_loss`)."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  model_dir = run_dir(out_dir, kind, eps)
  done = _finished(model_dir)
  if done:
    return done
  naive = ["train.model_config = @GPT2Config()", "train.clip_norms = None"]
  gin.clear_config()
  try:
    gin_cli.configure(list(gin_files), [
        *bindings, f"MODEL_DIR = '{model_dir}'",
        f"TARGET_EPSILON = {eps_name(eps)!r}",
        "train.eval_period = 1000000000",  # only at the last step
        "train.eval_examples = 1000000000",  # the whole held-out split
        "train.generate_after_training = False",
        *(naive if kind == "naive" else [])])
    return trainer.train()
  finally:
    gin.clear_config()


# ----------------------------------------------------------------------------
# Results file.
# ----------------------------------------------------------------------------


def _read_results(out_dir: str) -> dict[str, dict]:
  path = os.path.join(out_dir, RESULTS)
  rows = {}
  if os.path.isfile(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          rows[row["key"]] = row
  return rows


def _append_result(out_dir: str, row: dict) -> None:
  rows = _read_results(out_dir)
  rows[row["key"]] = row
  fileio.write_atomic(os.path.join(out_dir, RESULTS), "".join(
      json.dumps(r, allow_nan=True) + "\n" for r in rows.values()))


def _write_table(out_dir: str, name: str, header: Sequence[str],
                 rows: Sequence[Sequence], title: str) -> None:
  fmt = lambda v: (f"{v:.4f}" if isinstance(v, float) and math.isfinite(v)
                   else ("n/a" if isinstance(v, float) else str(v)))
  buf = io.StringIO()
  csv.writer(buf, lineterminator="\n").writerows(
      [header, *[[fmt(v) for v in r] for r in rows]])
  fileio.write_atomic(os.path.join(out_dir, f"{name}.csv"), buf.getvalue())
  lines = [f"# {title}", "", "| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
  fileio.write_atomic(os.path.join(out_dir, f"{name}.md"), "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------
# Table 4.
# ----------------------------------------------------------------------------


def table4(out_dir: str, *, epsilons: Sequence[float] = EPSILONS,
           gin_files: Sequence[str] = DEFAULT_GIN_FILES,
           bindings: Sequence[str] = ()) -> list[dict]:
  """LM test loss, naive vs multitask, per ε: table4.md / table4.csv."""
  os.makedirs(out_dir, exist_ok=True)
  for eps in epsilons:
    for kind in KINDS:
      key = f"table4/{kind}/{eps_name(eps)}"
      if key in _read_results(out_dir):
        continue
      summary = train_run(out_dir, kind, eps, gin_files=gin_files, bindings=bindings)
      _append_result(out_dir, {
          "key": key, "table": "table4", "kind": kind, "epsilon": eps_name(eps),
          "test_loss": summary["eval_loss"],
          "epsilon_spent": summary["epsilon_spent"], "delta": summary["delta"],
          "noise_multiplier": summary["noise_multiplier"],
          "steps": summary["steps"], "run_dir": run_dir(out_dir, kind, eps)})
  results = _read_results(out_dir)
  rows = [results[f"table4/{k}/{eps_name(e)}"] for e in epsilons for k in KINDS]
  _write_table(out_dir, "table4", ["epsilon", "loss (naive)", "loss (multitask)",
                                   "σ (naive)", "σ (multitask)"],
               [[eps_name(e), *(results[f"table4/{k}/{eps_name(e)}"]["test_loss"]
                                for k in KINDS),
                 *(results[f"table4/{k}/{eps_name(e)}"]["noise_multiplier"]
                   for k in KINDS)] for e in epsilons],
               "Table 4: LM test loss (naive vs multitask)")
  return rows


# ----------------------------------------------------------------------------
# Table 1.
# ----------------------------------------------------------------------------


def _classifier_accuracy(settings: Settings, train_texts, train_labels, test) -> float:
  if len(set(train_labels)) < 2:  # nothing to learn a decision from
    return math.nan
  tokenizer = tokenizers.ByteLevelBPETokenizer(textcls.DEFAULT_BPE_VOCAB_PATH,
                                               textcls.DEFAULT_BPE_MERGES_PATH)
  config = bert.BertConfig(
      vocab_size=tokenizer.get_vocab_size(),
      max_position_embeddings=settings.classifier_max_tokens,
      d_model=settings.classifier_width, num_layers=settings.classifier_layers,
      num_heads=4, d_ff=2 * settings.classifier_width, dropout_rate=0.0,
      num_labels=len(textcls.LABELS[settings.dataset]), pooling="mean")
  model = text_classifier.train_classifier(
      train_texts, train_labels, config=config, tokenizer=tokenizer,
      max_tokens=settings.classifier_max_tokens, batch_size=settings.classifier_batch,
      epochs=settings.classifier_epochs, learning_rate=settings.classifier_lr,
      seed=settings.seed)
  return model.accuracy([e.text for e in test], [e.label for e in test])


def _load_run(model_dir: str):
  mngr, step, meta = checkpoints.read_run(model_dir)
  config = trainable.config_from_json(meta.get("model_class"), meta["model_config"])
  return config, checkpoints.restore_params(mngr, step)


def generate(model_dir: str, labels: np.ndarray, settings: Settings, *,
             step_size: float) -> tuple[list[str], np.ndarray]:
  """(texts, [n, C] discriminator probabilities) of one sample per label
  from the run's `BOS label SEP` prompts; `step_size = 0` is plain
  conditional nucleus sampling."""
  vocab = textcls.conditional_vocabulary()  # the task's (data layer)
  config, params = _load_run(model_dir)
  eos = vocab.eos_id
  banned = [textcls.token_id(vocab, t) for t in textcls.EXTRA_TOKENS]
  texts, probs = [], []
  b = settings.generation_batch
  for start in range(0, len(labels), b):
    chunk = np.asarray(labels[start:start + b])
    padded = np.concatenate([chunk, np.zeros(b - len(chunk), chunk.dtype)])
    prompts = textcls.prompt_tokens(vocab, settings.dataset, padded)
    lengths = np.full(b, prompts.shape[1], np.int32)
    rng = jax.random.fold_in(jax.random.PRNGKey(settings.seed), start)
    out = np.asarray(pplm.pplm_generate_causal(
        config, params, prompts, lengths, padded, max_new_tokens=settings.max_new_tokens,
        rng=rng, step_size=step_size, num_iterations=settings.num_iterations,
        kl_scale=settings.kl_scale, gm_scale=settings.gm_scale, top_p=settings.top_p,
        eos_id=eos, banned_ids=banned))
    rows = pplm.generated_rows(prompts, lengths, out, eos)
    probs.append(pplm.discriminator_probs(config, params, rows,
                                          jax.random.fold_in(rng, 1))[:len(chunk)])
    for row in out[:len(chunk)]:
      ids = row.tolist()
      texts.append(vocab.decode(ids[:ids.index(eos)] if eos in ids else ids).strip())
  return texts, np.concatenate(probs)


def _write_synthetic(out_dir: str, name: str, texts, labels) -> None:
  buf = io.StringIO()
  writer = csv.writer(buf, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_NONE,
                      escapechar="\\")
  writer.writerow(["sentence", "label"])
  writer.writerows([" ".join(t.split()), int(y)] for t, y in zip(texts, labels))
  os.makedirs(os.path.join(out_dir, "synthetic"), exist_ok=True)
  fileio.write_atomic(os.path.join(out_dir, "synthetic", f"{name}.tsv"), buf.getvalue())


def table1(out_dir: str, *, epsilons: Sequence[float] = EPSILONS,
           gin_files: Sequence[str] = DEFAULT_GIN_FILES, bindings: Sequence[str] = (),
           settings: Settings = Settings()) -> list[dict]:
  """Downstream accuracy per ε (multitask + PPLM), the original-data row,
  Baseline 1 and memorisation: table1.md / table1.csv."""
  os.makedirs(out_dir, exist_ok=True)
  train = textcls.load_examples(settings.dataset, "train")
  test = textcls.load_examples(settings.dataset, "test")
  train_labels = np.asarray([e.label for e in train])
  if "original" not in _read_results(out_dir):
    _append_result(out_dir, {"key": "original", "table": "table1", "variant": "original",
                             "accuracy": _classifier_accuracy(
                                 settings, [e.text for e in train], train_labels, test)})
  counts = np.bincount(train_labels, minlength=len(textcls.LABELS[settings.dataset]))
  if settings.samples_per_class:
    counts = np.full_like(counts, settings.samples_per_class)
  labels = np.repeat(np.arange(len(counts)), counts)
  for eps in epsilons:
    key = f"table1/{eps_name(eps)}"
    if key in _read_results(out_dir):
      continue
    summary = train_run(out_dir, "multitask", eps, gin_files=gin_files, bindings=bindings)
    model_dir = run_dir(out_dir, "multitask", eps)
    row = {"key": key, "table": "table1", "variant": f"synthetic ε={eps_name(eps)}",
           "epsilon": eps_name(eps), "epsilon_spent": summary["epsilon_spent"],
           "delta": summary["delta"], "num_per_class": counts.tolist()}
    texts, probs = generate(model_dir, labels, settings, step_size=settings.step_size)
    _write_synthetic(out_dir, f"pplm_eps{eps_name(eps)}", texts, labels)
    row["accuracy"] = _classifier_accuracy(settings, texts, labels, test)
    row["pplm_disc_agreement"] = float(np.mean(probs.argmax(1) == labels))
    memo = text_quality.ngram_memorization(texts, (e.text for e in train),
                                           settings.ngram_orders)
    row["ngram_memorization"] = {str(n): r for n, r in memo.items()}
    row["ngram_memorization_mean"] = float(np.nanmean(list(memo.values())))
    plain, plain_probs = generate(model_dir, labels, settings, step_size=0.0)
    keep = pplm.filter_by_classifier(plain_probs, labels)
    _write_synthetic(out_dir, f"filtered_eps{eps_name(eps)}",
                     [t for t, k in zip(plain, keep) if k], labels[keep])
    row["baseline1_kept"] = int(keep.sum())
    row["baseline1_accuracy"] = (_classifier_accuracy(
        settings, [t for t, k in zip(plain, keep) if k], labels[keep], test)
        if keep.any() else math.nan)
    _append_result(out_dir, row)
  results = _read_results(out_dir)
  rows = [results["original"], *(results[f"table1/{eps_name(e)}"] for e in epsilons)]
  _write_table(
      out_dir, "table1",
      ["variant", "accuracy (multitask + PPLM)", "baseline 1 accuracy (filtered)",
       "baseline 1 kept", "n-gram memorisation (mean n=3..7)"],
      [["original", results["original"]["accuracy"], "", "", ""],
       *[[r["variant"], r["accuracy"], r["baseline1_accuracy"], r["baseline1_kept"],
          r["ngram_memorization_mean"]] for r in rows[1:]]],
      f"Table 1: downstream accuracy on the real {settings.dataset} test split")
  return rows
