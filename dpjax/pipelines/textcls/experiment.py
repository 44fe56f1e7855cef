"""Table 1 and Table 4 of "DP Conditional Text Generation for Synthetic
Data" (an ICLR 2023 submission, OpenReview LUql3ZOFwFD), one function each, on
run directories.

* `table4`: LM test loss at each ε, naive vs multitask. Naive = a plain
  GPT-2 DP-trained on the conditional task (one release per step);
  multitask = the GPT-2 + discriminator head (`gpt2_disc`: two releases per
  step, both in the ledger), same data, steps and (ε, δ). The loss is the
  LM's mean per-example loss on the held-out split (the text tokens; the
  `BOS label SEP` prompt is masked out in both).
* `table1`: downstream accuracy at each ε of three generators, each
  producing, per class, as many labelled texts as the training set holds
  (or `samples_per_class`) from `BOS label SEP` prompts; a BERT classifier
  (`text_classifier`, the same settings for every column) trained on them is
  scored on the real held-out split.
  - ours (Sec. 5.1.3): the multitask run (shared with Table 4), PPLM-steered
    nucleus sampling (`pplm.pplm_generate_causal`) by the run's own head;
  - Baseline 2 (Sec. 5.1.2): the naive LM `G_tuned`, then a post-hoc
    discriminator (the same MLP head and loss, `GPT2DiscConfig.head_only`)
    DP-trained on the frozen `G_tuned`; PPLM steered by that head;
  - Baseline 1 (Sec. 5.1.1): plain conditional nucleus sampling from the
    same `G_tuned`, kept where the post-hoc head gives p(a|x) > 0.5
    (`pplm.filter_by_classifier`); the kept count is reported. The paper
    fine-tunes a separate LM classifier as this filter; here the baselines
    share the one post-hoc head, so that both fit in the same budget.
  Also the "original data" row (the classifier on the real training texts)
  and the n-gram memorisation rate of our PPLM texts (n = 3..7).

The baseline pipeline (`train_baselines`) is two runs under ONE budget, as the
two-stage pipeline of Mireshghallah et al. (ACL 2023, arXiv 2212.10520):
`G_tuned` for T1 DP steps (the gin's EPOCHS or TRAIN_STEPS, one release per
step), then the head for T2 steps at the same sampling rate and clip bound C,
started from `G_tuned`'s params (`checkpoints.init_from_run`: the head is
freshly initialised); σ is calibrated once so that the T1 + T2 releases meet
(ε, δ), and the head run composes its ledger with the LM's
(`train.prior_ledger`). T2 = T1 by default (`Settings.head_epochs` = None): the
pipeline then makes as many LM releases and as many discriminator releases as
ours does (T of each, each one Gaussian of multiplier σ on a Poisson sample),
so the columns differ in joint versus post-hoc training, not in how many noisy
gradients each kind of parameter gets. The baseline LM is not Table 4's naive
run: its σ is larger, paying for the head's steps too.

Everything is resumable: finished trainings (a `train_summary.json` at the
planned step) are reused, a row already in `results.jsonl` is not redone,
and the tables are rewritten from `results.jsonl` each time. `Settings`
holds the generation, baseline-head and classifier settings; its defaults
fit the embedded SST-2 sample (tiny models, a 2-core CPU).

Formal guarantees: the synthetic texts, the classifiers trained on them and
their accuracies are post-processing of DP-trained params. Ours carries the
multitask run's (ε, δ) (`privacy_ledger.json` in its run directory); both
baselines carry the baseline pipeline's, whose ledger (that of the head run,
`runs/baseline_disc_eps*`) is one composition of the LM's T1 and the head's
T2 releases on the same data with the same δ = 1/n, so the ε it reports,
and that `table1` records, covers both trainings. The "original" row, the
test losses and accuracies on held-out data and the memorisation rate read
real data without DP: they are evaluation numbers, not releases.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
from typing import Any, Sequence

import gin
import jax
import numpy as np

from dpjax import configurables, errors, fileio, gin_cli
from dpjax.pipelines import harness, text_classifier
from dpjax.generation import inference, pplm
from dpjax.training import plan as plan_lib, trainer
from dpjax.pipelines.harness import eps_name
from dpjax.eval import text_quality
from dpjax.models import bert
from dpjax.data.readers import textcls
import tasks

EPSILONS = (3.0, 8.0, 16.0, 256.0, math.inf)
KINDS = ("naive", "multitask")
BASELINE_LM, BASELINE_DISC = "baseline_lm", "baseline_disc"
DEFAULT_GIN_FILES = ("textcls_sample.gin",)
RESULTS = "results.jsonl"


@dataclasses.dataclass(frozen=True)
class Settings:
  """Generation, baseline-head and downstream-classifier settings (the same
  for every ε). The dataset is the gin task's (`TaskData`)."""
  seed: int = 0
  # The post-hoc head's training length (None: as many steps as the LM).
  head_epochs: float | None = None
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


@dataclasses.dataclass(frozen=True)
class TaskData:
  """What Table 1 reads besides the runs, all from the gin task
  (`train.mixture_or_task_name`, registered as the trainer registers it):
  its dataset, its vocabulary (the runs' BPE + `EXTRA_TOKENS`, so prompts
  and decoding match the runs; its tokenizer also serves the downstream
  classifier) and the examples of its train and test splits."""
  dataset: str
  vocabulary: Any
  train: list[textcls.Example]
  test: list[textcls.Example]


def task_data(gin_files: Sequence[str] = DEFAULT_GIN_FILES,
              bindings: Sequence[str] = ()) -> TaskData:
  """`TaskData` of the gin config: the task's files (or TFDS) and BPE, the
  pretrained checkpoint's tokenizer when INITIAL_CHECKPOINT_PATH is set."""
  import seqio  # lazy: TensorFlow
  by_task = {f"{d}_conditional_lm": d for d in textcls.DATASETS}
  gin.clear_config()
  try:
    gin_cli.configure(list(gin_files), list(bindings))
    config = configurables.run_config()
    tasks.register_tasks(tokenizer_files=trainer.initial_tokenizer_files(
        config.initial_checkpoint_path))
    name = config.mixture_or_task_name
    if name not in by_task:
      raise errors.UsageError(
          f"MIXTURE_OR_TASK_NAME = {name!r}: the label-conditioned experiments "
          f"run on {sorted(by_task)}")
    task = seqio.get_mixture_or_task(name)
    split = lambda s: [textcls.Example(x["targets"].decode(), int(x["label"]))
                       for x in task.source.get_dataset(s, shuffle=False).as_numpy_iterator()]
    return TaskData(by_task[name], task.output_features["targets"].vocabulary,
                    split("train"), split("test"))
  finally:
    gin.clear_config()


# ----------------------------------------------------------------------------
# Runs.
# ----------------------------------------------------------------------------


def run_dir(out_dir: str, kind: str, eps: float) -> str:
  """The directory of the `kind` run at ε = `eps` under `out_dir`."""
  return os.path.join(out_dir, "runs", f"{kind}_eps{eps_name(eps)}")


# The naive GPT-2: the gin's model alone, one release per step.
_NAIVE = "train.model_config = @GPT2Config()"


def _train(model_dir: str, eps: float, gin_files: Sequence[str],
           bindings: Sequence[str], **fields) -> dict:
  """The train summary of the run in `model_dir`, trained (or resumed) at ε
  unless it has finished (`harness.train_run`): the gin files and
  `bindings`, then these RunConfig `fields`. The LM test loss is evaluated
  once, at the end (`eval_loss`), unless `fields` say otherwise."""
  return harness.train_run(model_dir, gin_files, bindings, **{
      "target_epsilon": eps,
      "eval_period": 1_000_000_000,  # only at the last step
      "eval_examples": 1_000_000_000,  # the whole held-out split
      "generate_after_training": False, **fields})


def train_run(out_dir: str, kind: str, eps: float, *,
              gin_files: Sequence[str] = DEFAULT_GIN_FILES,
              bindings: Sequence[str] = ()) -> dict:
  """The train summary of run (`kind`, ε), trained (or resumed) unless it has
  finished. Naive: the gin's GPT-2 alone (`train.model_config =
  @GPT2Config()`), one release per step; multitask: the gin's GPT2DiscConfig."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if kind == "naive":
    return _train(run_dir(out_dir, kind, eps), eps, gin_files,
                  [*bindings, _NAIVE], clip_norms=None)
  return _train(run_dir(out_dir, kind, eps), eps, gin_files, bindings)


def _train_size(task_name: str) -> int:
  """Examples in the train split of a registered task (what the trainer
  calls n)."""
  import seqio
  ds = seqio.get_mixture_or_task(task_name).get_dataset(None, split="train",
                                                        shuffle=False)
  n = int(ds.cardinality())
  return n if n >= 0 else int(ds.reduce(0, lambda count, _: count + 1))


def baseline_plan(eps: float, *, gin_files: Sequence[str] = DEFAULT_GIN_FILES,
                  bindings: Sequence[str] = (), head_epochs: float | None = None
                  ) -> dict:
  """The baseline pipeline's privacy plan at ε: n, δ, the steps (T1 of the
  LM, T2 of the head: `head_epochs`, None for T1) and the one σ (0 for
  ε = ∞) with which the events the two ledgers will record, T1 then T2 DP
  steps of one release each with the gin's sampler, meet (ε, δ)."""
  gin.clear_config()
  try:
    gin_cli.configure(list(gin_files), list(bindings))
    tasks.register_tasks()
    config = configurables.run_config()  # as the gin files configure the runs
  finally:
    gin.clear_config()
  n = _train_size(config.mixture_or_task_name)
  batch = int(config.batch_size)
  t1 = plan_lib.steps_for(config.train_steps, config.epochs, n, batch)
  t2 = t1 if head_epochs is None else plan_lib.steps_for(None, head_epochs, n, batch)
  delta, sigma = plan_lib.stages_plan(config, n, (t1, t2), eps)
  return {"dataset_size": n, "delta": delta, "steps": (t1, t2), "noise_multiplier": sigma}


def train_baselines(out_dir: str, eps: float, *,
                    gin_files: Sequence[str] = DEFAULT_GIN_FILES,
                    bindings: Sequence[str] = (), head_epochs: float | None = None
                    ) -> dict:
  """The summary of the baseline pipeline's head run at ε (its `epsilon_spent`
  is the pipeline's), after training what has not finished: `G_tuned`
  (`runs/baseline_lm_eps*`: the naive GPT-2, T1 steps), then the post-hoc
  head on it frozen (`runs/baseline_disc_eps*`: GPT2DiscConfig with
  `head_only`, the "disc" release alone, T2 steps, initialised from and
  composed after `G_tuned`'s run), both with `baseline_plan`'s σ."""
  lm_dir, disc_dir = (run_dir(out_dir, k, eps) for k in (BASELINE_LM, BASELINE_DISC))
  done = harness.finished_summary(disc_dir)
  if done:
    return done
  plan = baseline_plan(eps, gin_files=gin_files, bindings=bindings,
                       head_epochs=head_epochs)
  t1, t2 = plan["steps"]
  fixed = dict(eval_period=0, epochs=None,
               noise_multiplier=plan["noise_multiplier"],
               clip_norms=None)  # one release each, at train.clip_norm
  _train(lm_dir, eps, gin_files, [*bindings, _NAIVE], train_steps=t1, **fixed)
  return _train(disc_dir, eps, gin_files,
                [*bindings, "GPT2DiscConfig.head_only = True"],  # "disc" only
                train_steps=t2, initial_checkpoint_path=lm_dir,
                prior_ledger=lm_dir, **fixed)


# ----------------------------------------------------------------------------
# Results file.
# ----------------------------------------------------------------------------


def _read_results(out_dir: str) -> dict[str, dict]:
  """The results log's rows by key."""
  return {r["key"]: r for r in harness.read_results(
      os.path.join(out_dir, RESULTS))}


def _append_result(out_dir: str, row: dict) -> None:
  harness.append_result(os.path.join(out_dir, RESULTS), row)


def _write_table(out_dir: str, name: str, header: Sequence[str],
                 rows: Sequence[Sequence], title: str) -> None:
  fmt = lambda v: (f"{v:.4f}" if isinstance(v, float) and math.isfinite(v)
                   else ("n/a" if isinstance(v, float) else str(v)))
  harness.write_table([[fmt(v) for v in r] for r in rows], header,
                      os.path.join(out_dir, f"{name}.md"),
                      os.path.join(out_dir, f"{name}.csv"), title=title)


# ----------------------------------------------------------------------------
# Table 4.
# ----------------------------------------------------------------------------


def table4(out_dir: str, *, epsilons: Sequence[float] = EPSILONS,
           gin_files: Sequence[str] = DEFAULT_GIN_FILES,
           bindings: Sequence[str] = ()) -> list[dict]:
  """LM test loss, naive vs multitask, per ε: table4.md / table4.csv and
  table4_loss_vs_epsilon.png."""
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
  harness.plot_vs_epsilon(
      {kind: {float(r["epsilon"]): r["test_loss"] for r in rows
              if r["kind"] == kind} for kind in KINDS},
      os.path.join(out_dir, "table4_loss_vs_epsilon.png"), "LM test loss",
      title="Table 4: naive vs multitask")
  return rows


# ----------------------------------------------------------------------------
# Table 1.
# ----------------------------------------------------------------------------


def _classifier_accuracy(settings: Settings, data: TaskData, train_texts,
                         train_labels) -> float:
  """Accuracy on `data.test` of the downstream classifier trained on the texts."""
  if len(set(train_labels)) < 2:  # nothing to learn a decision from
    return math.nan
  tokenizer = data.vocabulary.tokenizer
  config = bert.BertConfig(
      vocab_size=tokenizer.get_vocab_size(),
      max_position_embeddings=settings.classifier_max_tokens,
      d_model=settings.classifier_width, num_layers=settings.classifier_layers,
      num_heads=4, d_ff=2 * settings.classifier_width, dropout_rate=0.0,
      num_labels=len(textcls.LABELS[data.dataset]), pooling="mean")
  model = text_classifier.train_classifier(
      train_texts, train_labels, config=config, tokenizer=tokenizer,
      max_tokens=settings.classifier_max_tokens, batch_size=settings.classifier_batch,
      epochs=settings.classifier_epochs, learning_rate=settings.classifier_lr,
      seed=settings.seed)
  return model.accuracy([e.text for e in data.test], [e.label for e in data.test])


def generate(model_dir: str, labels: np.ndarray, settings: Settings, data: TaskData,
             *, step_size: float) -> tuple[list[str], np.ndarray]:
  """(texts, [n, C] discriminator probabilities) of one sample per label
  from the run's `BOS label SEP` prompts; `step_size = 0` is plain
  conditional nucleus sampling."""
  vocab = data.vocabulary
  config, params, _ = inference.load_trained(model_dir)
  # What trained (`head_only`, `frozen_layers`) does not change what the
  # model computes: the baselines' head run then samples with the programs
  # compiled for our multitask run.
  config = dataclasses.replace(config, head_only=False, frozen_layers=())
  eos = vocab.eos_id
  banned = [textcls.token_id(vocab, t) for t in textcls.EXTRA_TOKENS]
  texts, probs = [], []
  b = settings.generation_batch
  for start in range(0, len(labels), b):
    chunk = np.asarray(labels[start:start + b])
    padded = np.concatenate([chunk, np.zeros(b - len(chunk), chunk.dtype)])
    prompts = textcls.prompt_tokens(vocab, data.dataset, padded)
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


def _ours_row(out_dir, eps, labels, counts, settings, data, gin_files, bindings):
  """Ours at ε: the multitask run, PPLM by its head, accuracy, memorisation."""
  summary = train_run(out_dir, "multitask", eps, gin_files=gin_files, bindings=bindings)
  texts, probs = generate(run_dir(out_dir, "multitask", eps), labels, settings, data,
                          step_size=settings.step_size)
  _write_synthetic(out_dir, f"pplm_eps{eps_name(eps)}", texts, labels)
  memo = text_quality.ngram_memorization(texts, (e.text for e in data.train),
                                         settings.ngram_orders)
  return {"variant": f"synthetic ε={eps_name(eps)}", "epsilon": eps_name(eps),
          "epsilon_spent": summary["epsilon_spent"], "delta": summary["delta"],
          "num_per_class": counts.tolist(),
          "accuracy": _classifier_accuracy(settings, data, texts, labels),
          "pplm_disc_agreement": float(np.mean(probs.argmax(1) == labels)),
          "ngram_memorization": {str(n): r for n, r in memo.items()},
          "ngram_memorization_mean": float(np.nanmean(list(memo.values())))}


def _baselines_row(out_dir, eps, labels, settings, data, gin_files, bindings):
  """Baselines 2 and 1 at ε, both from the baseline pipeline's head run."""
  summary = train_baselines(out_dir, eps, gin_files=gin_files, bindings=bindings,
                            head_epochs=settings.head_epochs)
  disc_dir = run_dir(out_dir, BASELINE_DISC, eps)
  steered, steered_probs = generate(disc_dir, labels, settings, data,
                                    step_size=settings.step_size)
  _write_synthetic(out_dir, f"posthoc_pplm_eps{eps_name(eps)}", steered, labels)
  plain, plain_probs = generate(disc_dir, labels, settings, data, step_size=0.0)
  keep = pplm.filter_by_classifier(plain_probs, labels)
  kept = [t for t, k in zip(plain, keep) if k]
  _write_synthetic(out_dir, f"filtered_eps{eps_name(eps)}", kept, labels[keep])
  return {"epsilon": eps_name(eps), "epsilon_spent": summary["epsilon_spent"],
          "delta": summary["delta"], "noise_multiplier": summary["noise_multiplier"],
          "steps": [harness.finished_summary(run_dir(out_dir, BASELINE_LM, eps))["steps"],
                    summary["steps"]],
          "run_dir": disc_dir,
          "baseline2_accuracy": _classifier_accuracy(settings, data, steered, labels),
          "baseline2_disc_agreement": float(np.mean(steered_probs.argmax(1) == labels)),
          "baseline1_kept": int(keep.sum()),
          # NaN when the filter keeps fewer than two classes
          "baseline1_accuracy": _classifier_accuracy(settings, data, kept, labels[keep])}


def table1(out_dir: str, *, epsilons: Sequence[float] = EPSILONS,
           gin_files: Sequence[str] = DEFAULT_GIN_FILES, bindings: Sequence[str] = (),
           settings: Settings = Settings()) -> list[dict]:
  """Downstream accuracy per ε of ours (multitask + PPLM), Baseline 2
  (post-hoc head + PPLM) and Baseline 1 (filtered), the original-data row
  and memorisation: table1.md / table1.csv, table1_accuracy_vs_epsilon.png.
  Returns the original row, then
  per ε ours (key `table1/ε`) and the baselines (key `table1/baselines/ε`)."""
  os.makedirs(out_dir, exist_ok=True)
  data = task_data(gin_files, bindings)
  train_labels = np.asarray([e.label for e in data.train])
  if "original" not in _read_results(out_dir):
    _append_result(out_dir, {"key": "original", "table": "table1", "variant": "original",
                             "accuracy": _classifier_accuracy(
                                 settings, data, [e.text for e in data.train], train_labels)})
  counts = np.bincount(train_labels, minlength=len(textcls.LABELS[data.dataset]))
  if settings.samples_per_class:
    counts = np.full_like(counts, settings.samples_per_class)
  labels = np.repeat(np.arange(len(counts)), counts)
  for eps in epsilons:
    ours, baselines = (f"table1/{eps_name(eps)}", f"table1/baselines/{eps_name(eps)}")
    if ours not in _read_results(out_dir):
      _append_result(out_dir, {"key": ours, "table": "table1", **_ours_row(
          out_dir, eps, labels, counts, settings, data, gin_files, bindings)})
    if baselines not in _read_results(out_dir):
      _append_result(out_dir, {"key": baselines, "table": "table1", **_baselines_row(
          out_dir, eps, labels, settings, data, gin_files, bindings)})
  results = _read_results(out_dir)
  per_eps = [(results[f"table1/{eps_name(e)}"], results[f"table1/baselines/{eps_name(e)}"])
             for e in epsilons]
  _write_table(
      out_dir, "table1",
      ["variant", "ours (multitask + PPLM)", "baseline 2 (post-hoc disc + PPLM)",
       "baseline 1 (filtered)", "baseline 1 kept", "n-gram memorisation (ours, mean n=3..7)"],
      [["original", results["original"]["accuracy"], "", "", "", ""],
       *[[o["variant"], o["accuracy"], b["baseline2_accuracy"], b["baseline1_accuracy"],
          b["baseline1_kept"], o["ngram_memorization_mean"]] for o, b in per_eps]],
      f"Table 1: downstream accuracy on the real {data.dataset} test split")
  harness.plot_vs_epsilon(
      {label: {float(o["epsilon"]): pick(o, b) for o, b in per_eps}
       for label, pick in (
           ("ours (multitask + PPLM)", lambda o, b: o["accuracy"]),
           ("baseline 2 (post-hoc disc + PPLM)",
            lambda o, b: b["baseline2_accuracy"]),
           ("baseline 1 (filtered)", lambda o, b: b["baseline1_accuracy"]))},
      os.path.join(out_dir, "table1_accuracy_vs_epsilon.png"),
      "downstream accuracy", title=f"Table 1 ({data.dataset})",
      references={"original data": results["original"]["accuracy"]})
  return [results["original"], *(r for pair in per_eps for r in pair)]
