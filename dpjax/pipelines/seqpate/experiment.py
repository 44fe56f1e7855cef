"""SeqPATE's Table 1 and ablation rows (Tian et al., NeurIPS 2022, Tables 1, 3,
4, 6, App. O) on AirDialogue or Europarl: perplexity, BLEU-3/4 and name
leakage.

Steps, each skipped when its output exists (rerunning resumes):

1. Splits (`tasks.seqpate.completion_splits`). AirDialogue: the users of
   `train_data.json` split into public (`public_fraction` of them) and
   private, so no private user's sentence is public; the private test set is
   `dev_data.json`. Europarl (no users): a seeded random split of the
   sentences into private / public / test.
2. Pub-GPT: the public pre-trained model. The samples have no pre-trained
   GPT-2, so a tiny one is trained (plain Adam) on the public sentences.
3. Pseudo-data: the public prefixes completed by Pub-GPT
   (`pseudo_data.complete_prefixes`, top-p 0.95 sampling).
4. Teachers: Pub-GPT fine-tuned on the private partitions (sample-level by
   default, `partition="user"` for by-user), top-k cached on the pseudo-data
   (`teachers.train_and_cache`).
5. Rows (paper Tables 1, 3 and 4):
   * Pub-GPT; Pub-GPT+D^pub (warm-up on the pseudo-data only: the student
     without any teacher, i.e. "pseudo loss only"); Pri-GPT (Pub-GPT
     fine-tuned on the private training set, no privacy: the leakage
     reference).
   * NoisySGD: Pub-GPT fine-tuned on the private training set with DP-SGD at
     the same (ε, δ) by dpjax's trainer (`noisysgd`, gin/seqpate_noisysgd.gin:
     batch 32, Adam, Poisson sampling, σ calibrated by dp-accounting);
     NoisySGD+D^pub: then fine-tuned without privacy on the pseudo-data
     (as the warm-up). ε spent is the trainer's ledger's.
   * SeqPATE: warm-up, then distillation with top-p 0.95 candidates
     (`student`) from the summed teacher distributions + Gaussian noise.
   * -Merge_P (teacher votes): the teachers' votes aggregated instead of
     their distributions: each teacher votes for its most likely token over
     the whole vocabulary (PATE's vote), the vote histogram restricted to
     the candidates + Gaussian noise, clipped, renormalised (sensitivity
     sqrt(2), as for distributions). Voting over the vocabulary rather than
     for a teacher's best candidate keeps the histogram independent of the
     candidate set, so restricting it stays post-processing of one
     mechanism per (sentence, position), as for SeqPATE's answers.
   * -KL (teacher top-1 CE): cross-entropy with the aggregate's top-1
     instead of the KL (paper Sec. 6.3), same queries.
   * -Gaussian (Laplace): the Laplace mechanism of the original PATE on the
     summed distributions (L1 sensitivity 2, scale b calibrated for ε with
     dp-accounting).
   * filter top-k=K: the student's top-K tokens as candidates (Table 4).
   * Not in the paper: -filter (whole vocabulary): no candidate filtering;
     no noise (eps=inf): noise-free aggregation, epsilon infinite.
   Every teacher-supervised row has its own ledger and answer store (budget
   `max_queries`, noise calibrated for epsilon); epsilon spent is read from
   it.

Evaluation on the private test set: `dpjax.pipelines.seqpate.evaluation` (PPL,
BLEU-3/4, name leakage), and
* Per-phrase epsilon (`partition="user"`, AirDialogue; paper Sec. 5.3,
  Table 6): the secret phrases are the private users' full names; each
  teacher-supervised row's ledger gives every name's epsilon from the number
  of teachers holding it (`accounting.phrase_epsilons`); the table shows
  min / avg / max over the names that occur in the private data. The noise
  is calibrated at sample level (a name held by one teacher gets the row's
  epsilon).

Outputs in `output_dir/dataset/` (`output_dir/dataset-user/` for the
user-level partition): results.jsonl (one line per row and seed),
table1.md, table1.csv.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Callable, Sequence

import flax.serialization
import jax
import numpy as np
import tokenizers

from dpjax import fileio, pretrained
from dpjax.pipelines import harness
from dpjax.models import gpt2
from dpjax.privacy import secret as secret_lib
from dpjax.pipelines.seqpate import (accounting, aggregation, cache, evaluation,
                           noisysgd, partition, pseudo_data, student,
                           teachers)
from dpjax.data.readers import seqpate as data
from tasks import pretraining

DATASETS = data.DATASETS


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a table depends on; the defaults run the embedded samples
  on a CPU in minutes (the paper: GPT-2 small, 2k teachers, 40 tokens)."""
  model: gpt2.GPT2Config = gpt2.GPT2Config(
      vocab_size=1255, n_positions=64, d_model=64, num_layers=2, num_heads=4,
      dropout_rate=0.0)
  # Where Pub-GPT's fine-tuning starts (the paper: GPT-2): a Hugging Face
  # GPT-2 of `model`'s shape; the default is the shipped one pretrained on
  # the public world's sentences (python -m dpjax.pretrain
  # --gin_file=gin/pretrain/seqpate_gpt2.gin). None: random weights.
  initial_checkpoint: str | None = pretraining.PATHS_ABS[
      "PRETRAINED_SEQPATE_GPT2"]
  length: int = 40
  public_fraction: float = 0.2
  test_fraction: float = 0.1  # Europarl only
  batch_size: int = 32
  public_epochs: int = 20
  public_learning_rate: float = 3e-3
  private_epochs: int = 5  # Pri-GPT
  private_learning_rate: float = 1e-3
  num_teachers: int = 64
  teacher: teachers.TeacherSetup = teachers.TeacherSetup(
      batch_size=8, epochs=5, learning_rate=1e-3, group_size=32, top_k=20)
  partition: str = "sample"
  student: student.StudentSetup = student.StudentSetup(
      batch_size=32, warmup_epochs=3, kd_epochs=3, learning_rate=1e-3)
  max_candidates: int = 64
  max_queries: int = 500
  epsilon: float = 3.0
  top_k_rows: tuple[int, ...] = (10,)
  max_examples: int | None = None  # caps private and public (smoke tests)
  max_test: int | None = None
  # The NoisySGD rows' trainer configuration (model, ε, δ, seed and data
  # are bound from these settings).
  noisysgd_gin_files: tuple[str, ...] = noisysgd.GIN_FILES
  noisysgd_bindings: tuple[str, ...] = ()


class Tokenizer:
  """The sample's byte-level BPE through `tokenizers` (no TensorFlow)."""

  def __init__(self, vocab_dir: str = data.DEFAULT_VOCAB_DIR):
    self._bpe = tokenizers.ByteLevelBPETokenizer(
        os.path.join(vocab_dir, "vocab.json"),
        os.path.join(vocab_dir, "merges.txt"))
    self.eos_id = self._bpe.token_to_id("<|endoftext|>")

  def encode(self, text: str) -> list[int]:
    """The token ids of `text` (no EOS added)."""
    return self._bpe.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`."""
    return self._bpe.decode(list(ids))


def load_splits(dataset: str, settings: Settings, seed: int) -> dict:
  """{"private", "public", "test"}: lists of `tasks.seqpate.Completion`,
  private and public capped at `max_examples`."""
  splits = data.completion_splits(
      dataset, seed, public_fraction=settings.public_fraction,
      test_fraction=settings.test_fraction)
  for name in ("private", "public"):
    splits[name] = splits[name][:settings.max_examples]
  return splits


def save_params(path: str, params) -> None:
  """Writes `params` to `path` atomically, in flax's msgpack format."""
  with fileio.open_atomic(path, "wb") as f:
    f.write(flax.serialization.to_bytes(params))


def load_params(path: str, config: gpt2.GPT2Config, length: int):
  """Reads `save_params`' file as the params of GPT-2 `config` at `length`."""
  # The tree's structure from its shapes: no initialiser compiled and run.
  template = gpt2.abstract_params(config, max_length=length)[0]
  with open(path, "rb") as f:
    return flax.serialization.from_bytes(template, f.read())


def train_lm(config, init_params, arrays: dict, *, epochs: int,
             learning_rate: float, batch_size: int, seed: int,
             log: Callable[[str], None]):
  """Plain (non-private) LM fine-tuning: the student's pseudo-label phase
  on `arrays` {"tokens", "loss_weights"}."""
  lm = student.Student(config, init_params, arrays, student.StudentSetup(
      batch_size=batch_size, warmup_epochs=epochs, kd_epochs=0,
      learning_rate=learning_rate, distill="none", seed=seed))
  lm.warmup(log)
  return lm.params


@functools.lru_cache(maxsize=None)
# Rows: name -> (kind, student/aggregator options).
def table_rows(settings: Settings) -> dict[str, tuple[str, dict]]:
  """Table 1's rows: name -> (kind, student/aggregator options)."""
  rows = {"Pub-GPT": ("public", {}),
          "Pub-GPT+D^pub": ("warmup", {}),
          "Pri-GPT (no DP)": ("private", {}),
          "NoisySGD": ("noisysgd", {}),
          "NoisySGD+D^pub": ("noisysgd+dpub", {}),
          "SeqPATE": ("student", {}),
          "-Merge_P (teacher votes)": ("student", {"aggregate": "votes"}),
          "-KL (teacher top-1 CE)": ("student", {"distill": "top1"}),
          "-Gaussian (Laplace)": ("student", {"mechanism": "laplace"})}
  for k in settings.top_k_rows:
    rows[f"filter top-k={k}"] = ("student", {"top_p": 1.0, "top_k": k,
                                             "max_candidates": max(
                                                 k, settings.max_candidates)})
  rows["-filter (whole vocabulary)"] = (
      "student", {"top_p": 1.0, "max_candidates": settings.model.vocab_size})
  rows["no noise (eps=inf)"] = ("student", {"noise": False})
  return rows


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def _write_json(path, obj):
  fileio.write_atomic(path, json.dumps(obj, indent=2))


def _slug(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def table1(output_dir: str, *, dataset: str = "airdialogue",
           seeds: Sequence[int] = (0,), settings: Settings = Settings(),
           rows: Sequence[str] | None = None,
           log: Callable[[str], None] = print) -> dict:
  """Runs the table (resumable); returns {"rows": [...], "table_md": path}."""
  # The user-level table apart: its teacher rows differ, same names.
  root = os.path.join(os.path.abspath(output_dir), dataset + (
      "" if settings.partition == "sample" else f"-{settings.partition}"))
  os.makedirs(root, exist_ok=True)
  harness.check_settings(root, settings)
  tokenizer = Tokenizer()
  config, length = settings.model, settings.length
  all_rows = table_rows(settings)
  chosen = list(rows or all_rows)
  unknown = set(chosen) - set(all_rows)
  if unknown:
    raise ValueError(f"unknown rows {sorted(unknown)}; known: {list(all_rows)}")
  results = []
  for seed in seeds:
    run_dir = os.path.join(root, f"seed{seed}")
    os.makedirs(run_dir, exist_ok=True)
    splits = load_splits(dataset, settings, seed)
    arrays = {k: data.encode_completions(v, tokenizer, length)
              for k, v in splits.items()}
    test_examples = splits["test"][:settings.max_test]
    n_test = len(test_examples)
    test = {"arrays": {k: v[:n_test] for k, v in arrays["test"].items()},
            "prefixes": [e.prefix for e in test_examples],
            "references": [" ".join(e.text.split()[len(e.prefix.split()):])
                           for e in test_examples]}
    names = (sorted({e.user_id for e in splits["private"]})
             if dataset == "airdialogue" else None)
    log(f"[{dataset} seed {seed}] private {len(splits['private'])}, public "
        f"{len(splits['public'])}, test {n_test} examples")

    def model(name, make):
      path = os.path.join(run_dir, f"{name}.msgpack")
      if not os.path.isfile(path):
        t = time.time()
        save_params(path, make())
        log(f"[{dataset} seed {seed}] {name}: {time.time() - t:.0f}s")
      return load_params(path, config, length)

    if settings.initial_checkpoint:
      init = pretrained.load_pretrained(settings.initial_checkpoint, config)
    else:
      init = gpt2.init_params(config, jax.random.key(seed),
                              max_length=length)[0]
    public = model("pub_gpt", lambda: train_lm(
        config, init, arrays["public"], epochs=settings.public_epochs,
        learning_rate=settings.public_learning_rate,
        batch_size=settings.batch_size, seed=seed, log=log))
    pseudo_path = os.path.join(run_dir, "pseudo.npz")
    if not os.path.isfile(pseudo_path):
      generated = pseudo_data.complete_prefixes(
          config, public, arrays["public"]["tokens"][
              :, :int(arrays["public"]["prefix_lengths"].max())],
          arrays["public"]["prefix_lengths"], length=length,
          rng=jax.random.key(seed), eos_id=tokenizer.eos_id, top_p=0.95)
      with fileio.open_atomic(pseudo_path, "wb") as f:
        np.savez(f, **generated)
    with np.load(pseudo_path) as f:
      pseudo = {k: f[k] for k in f.files}

    def on_pseudo(name, params):  # the "+D^pub" fine-tuning, no privacy
      return model(name, lambda: train_lm(
          config, params, pseudo, epochs=settings.student.warmup_epochs,
          learning_rate=settings.student.learning_rate,
          batch_size=settings.student.batch_size, seed=seed, log=log))

    @functools.cache
    def noisy_sgd():
      params, ledger = noisysgd.train_noisysgd(
          os.path.join(run_dir, "noisysgd_trainer"), config=config,
          init_params=public, dataset=dataset, split_seed=seed,
          public_fraction=settings.public_fraction,
          test_fraction=settings.test_fraction,
          max_examples=settings.max_examples, length=length,
          epsilon=settings.epsilon, delta=accounting.DELTA, seed=seed,
          gin_files=settings.noisysgd_gin_files,
          bindings=settings.noisysgd_bindings)
      return params, {"epsilon_spent": ledger.epsilon_spent(),
                      "delta": ledger.delta,
                      "noise_multiplier": ledger.noise_multiplier,
                      "queries": 0, "dp_steps": ledger.steps}

    teacher_cache = _TeacherCache(run_dir, settings, public,
                                  arrays["private"], splits["private"],
                                  pseudo, seed, log)
    for name in chosen:
      kind, options = all_rows[name]
      row_dir = os.path.join(run_dir, _slug(name))
      scores_path = os.path.join(row_dir, "scores.json")
      if os.path.isfile(scores_path):
        results.append(_read_json(scores_path))
        continue
      os.makedirs(row_dir, exist_ok=True)
      t = time.time()
      privacy = {"epsilon_spent": 0.0, "queries": 0}
      if kind == "public":
        params = public
      elif kind == "warmup":
        params = on_pseudo("warmup", public)
      elif kind == "private":
        params = model("pri_gpt", lambda: train_lm(
            config, public, arrays["private"], epochs=settings.private_epochs,
            learning_rate=settings.private_learning_rate,
            batch_size=settings.batch_size, seed=seed, log=log))
        privacy = {"epsilon_spent": math.inf, "queries": 0}
      elif kind in ("noisysgd", "noisysgd+dpub"):
        params, privacy = noisy_sgd()
        if kind == "noisysgd+dpub":
          params = on_pseudo("noisysgd_dpub", params)
      else:
        params, privacy = _distill(
            row_dir, settings, config, on_pseudo("warmup", public), pseudo,
            teacher_cache, len(splits["private"]), options, seed, log,
            phrase_counts=teacher_cache.phrase_counts(names)
            if settings.partition == "user" and names else None)
      row = {"row": name, "dataset": dataset, "seed": seed, **privacy,
             **evaluation.evaluate(config, params, test, tokenizer, names),
             "seconds": round(time.time() - t, 1)}
      _write_json(scores_path, row)
      log(f"[{dataset} seed {seed}] {name}: ppl {row['ppl']:.2f}, bleu3 "
          f"{row['bleu3']:.2f}, bleu4 {row['bleu4']:.2f}"
          + (f", name leakage {row['name_leakage']:.4f}" if names else ""))
      results.append(row)
  return _write_table(root, results, dataset, settings)


class _TeacherCache:
  """One seed's teachers, trained (or read from their cache) on first use;
  their sums per aggregate, and the teachers holding each secret phrase."""

  def __init__(self, run_dir, settings, public, private_arrays,
               private_examples, pseudo, seed, log):
    self.settings, self.seed, self.log = settings, seed, log
    self.public, self.private_arrays = public, private_arrays
    self.private_examples, self.pseudo = private_examples, pseudo
    self.cache_dir = os.path.join(run_dir, f"teachers_{settings.partition}")
    self._sums = {}

  @functools.cached_property
  def assignment(self) -> np.ndarray:
    settings, n = self.settings, len(self.private_examples)
    if settings.partition == "sample":
      return partition.sample_partition(n, settings.num_teachers, self.seed)
    if settings.partition == "user":
      return partition.user_partition(
          [e.user_id for e in self.private_examples], settings.num_teachers,
          self.seed)
    raise ValueError(f"partition must be 'sample' or 'user', got "
                     f"{settings.partition!r}")

  def __getitem__(self, aggregate: str) -> cache.TeacherSums:
    if not self._sums:
      t = time.time()
      setup = dataclasses.replace(self.settings.teacher, seed=self.seed)
      mesh = teachers.teacher_mesh(jax.devices()[:1]) if (
          setup.group_size % len(jax.devices())) else None
      teachers.train_and_cache(
          self.settings.model, self.public, self.private_arrays["tokens"],
          self.private_arrays["loss_weights"], self.assignment,
          self.pseudo["tokens"], self.cache_dir, setup, mesh=mesh,
          log=self.log)
      self.log(f"teachers ({self.settings.num_teachers}, "
               f"{self.settings.partition}-level): {time.time() - t:.0f}s")
    if aggregate not in self._sums:
      self._sums[aggregate] = cache.TeacherSums.from_cache(
          self.cache_dir, self.settings.num_teachers,
          pseudo_fingerprint=cache.fingerprint(self.pseudo["tokens"]),
          aggregate=aggregate)
    return self._sums[aggregate]

  def phrase_counts(self, phrases: Sequence[str]) -> np.ndarray:
    """Teachers whose private texts contain each phrase."""
    return partition.phrase_teacher_counts(
        phrases, [e.text for e in self.private_examples], self.assignment)


def _distill(row_dir, settings, config, warm, pseudo, teacher_cache,
             n_private, options, seed, log, phrase_counts=None):
  """The KD phase of one row from the warm-up student; returns (params,
  privacy), with the per-phrase epsilons' summary given the teachers holding
  each phrase (`phrase_counts`)."""
  options = dict(options)
  noise = options.pop("noise", True)
  mechanism = options.pop("mechanism", "gaussian")
  aggregate = options.pop("aggregate", "distribution")
  width = options.pop("max_candidates", settings.max_candidates)
  setup = dataclasses.replace(settings.student, warmup_epochs=0, seed=seed,
                              **options)
  sums = teacher_cache[aggregate]
  if os.path.isfile(os.path.join(row_dir, aggregation.ANSWERS_FILENAME)):
    agg = aggregation.Aggregator.restore(row_dir, sums, max_candidates=width)
  else:
    ledger = accounting.make_ledger(
        settings.epsilon if noise else math.inf, settings.max_queries,
        num_teachers=settings.num_teachers, dataset_size=n_private,
        scale=None if noise else 0.0, mechanism=mechanism,
        aggregate=aggregate)
    agg = aggregation.Aggregator(
        sums, ledger, secret=secret_lib.for_run(row_dir, resuming=False),
        max_candidates=width)
  kd = student.Student(config, warm, pseudo, setup)
  stats = kd.distill(agg, log)
  agg.save(row_dir)
  privacy = {
      "epsilon_spent": agg.ledger.epsilon_spent(),
      "delta": agg.ledger.delta, "mechanism": mechanism,
      "aggregate": aggregate, "noise_scale": agg.scale,
      "queries": int(sum(e.count for e in agg.ledger.events)),
      "max_queries": agg.max_queries,
      "distilled_positions": stats.distilled_positions}
  if phrase_counts is not None:
    privacy["phrase_epsilon"] = accounting.summarize_phrase_epsilons(
        accounting.phrase_epsilons(agg.ledger, phrase_counts), phrase_counts)
  return kd.params, privacy


def _epsilon(value: float, digits: int = 3) -> str:
  return f"{value:.{digits}f}" if math.isfinite(value) else "∞"


def _phrase_cells(group: list[dict]) -> list[str]:
  """min / avg / max phrase epsilon (the largest over seeds)."""
  if all("phrase_epsilon" in g for g in group):
    return [_epsilon(max(g["phrase_epsilon"][f"epsilon_{k}"] for g in group),
                     2) for k in ("min", "avg", "max")]
  spent = max(g["epsilon_spent"] for g in group)
  # No private data: 0 for every phrase; non-private: ∞; DP-SGD: not
  # computed (its per-phrase ε needs group privacy over the phrase's count).
  known = spent == 0 or math.isinf(spent)
  return [_epsilon(spent, 2) if known else "—"] * 3


def _write_table(root: str, rows: list[dict], dataset: str,
                 settings: Settings) -> dict:
  """results.jsonl and table1.{md,csv}; one ε per table, so no figure
  against ε."""
  harness.write_results(os.path.join(root, harness.RESULTS_FILENAME), rows)
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault(r["row"], []).append(r)
  metrics = ["ppl", "bleu3", "bleu4"] + (
      ["name_leakage"] if "name_leakage" in rows[0] else [])
  phrases = settings.partition == "user" and "name_leakage" in metrics
  header = ["method", "PPL", "BLEU-3", "BLEU-4"] + (
      ["name leakage %"] if "name_leakage" in metrics else []) + [
          "ε spent"] + (["phrase ε min", "phrase ε avg", "phrase ε max"]
                        if phrases else []) + ["queries", "seeds"]
  table = []
  for name, group in groups.items():
    cells = [name] + [harness.mean_std(
        [g[m] * (100 if m == "name_leakage" else 1) for g in group], digits=2)
                      for m in metrics]
    cells.append(_epsilon(max(g["epsilon_spent"] for g in group)))
    if phrases:
      cells += _phrase_cells(group)
    steps = max(g.get("dp_steps", 0) for g in group)
    cells += [f"{steps} DP-SGD steps" if steps else
              str(max(g["queries"] for g in group)), str(len(group))]
    table.append(cells)
  notes = ["PPL on the private test sentences; BLEU-n (sacrebleu, "
           "0-100) of greedy completions of the test prefixes; name leakage: "
           "completions naming a private training user. mean ± std over "
           "seeds. Pub-GPT and Pub-GPT+D^pub use no private data (ε 0); "
           "Pri-GPT is trained on it without privacy (ε ∞). NoisySGD: "
           "DP-SGD (add-or-remove-one adjacency); teacher queries: "
           "replace-one adjacency, as in the paper compared at the same "
           "nominal ε. -Merge_P: teacher votes; -Gaussian: Laplace noise; "
           "-filter and no noise are not rows of the paper."]
  if phrases:
    notes[0] += ("\nPhrase ε: per private user's full name, from the "
                 "teachers holding it (the noise is calibrated for a name on "
                 "one teacher); min / avg / max over the names in the "
                 "private data; — where not computed (DP-SGD).")
  md = os.path.join(root, "table1.md")
  harness.write_table(
      table, header, md, os.path.join(root, "table1.csv"),
      title=f"SeqPATE on {dataset}: Table 1 and ablations (target ε = "
            f"{settings.epsilon:g}, δ = {accounting.DELTA:g}, "
            f"{settings.num_teachers} teachers, {settings.partition}-level, "
            f"budget {settings.max_queries} queries)", notes=notes)
  return {"table_md": md, "rows": rows}
