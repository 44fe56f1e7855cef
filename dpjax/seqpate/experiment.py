"""SeqPATE's Table 1 and ablation rows (shared/papers/001, Tables 1, 3, 4,
App. O) on AirDialogue or Europarl: perplexity, BLEU-3/4 and name leakage.

Steps, each skipped when its output exists (rerunning resumes):

1. Splits. AirDialogue: the users of `train_data.json` split into public
   (`public_fraction` of them) and private, so no private user's sentence is
   public; the private test set is `dev_data.json`. Europarl (no users): a
   seeded random split of the sentences into private / public / test.
2. Pub-GPT: the public pre-trained model. The samples have no pre-trained
   GPT-2, so a tiny one is trained (plain Adam) on the public sentences.
3. Pseudo-data: the public prefixes completed by Pub-GPT
   (`pseudo_data.complete_prefixes`, top-p 0.95 sampling).
4. Teachers: Pub-GPT fine-tuned on the private partitions (sample-level by
   default, `partition="user"` for by-user), top-k cached on the pseudo-data
   (`teachers.train_and_cache`).
5. Rows. Pub-GPT; Pub-GPT+D^pub (warm-up on the pseudo-data only: the
   student without any teacher, i.e. "pseudo loss only"); Pri-GPT (Pub-GPT
   fine-tuned on the private training set, no privacy: the leakage
   reference); SeqPATE (warm-up, then distillation with top-p 0.95
   candidates, `student`); and its ablations:
   * -Merge_P: no candidate filtering, the whole vocabulary is queried.
     (The paper's -Merge_P instead aggregates by teacher votes.)
   * -KL: cross-entropy with the teachers' top-1 instead of the KL (paper
     Sec. 6.3), same queries.
   * -Gaussian: noise-free aggregation, recorded as epsilon = inf. (The
     paper's -Gaussian uses the Laplace mechanism.)
   * top-k=K: the student's top-K tokens as candidates (paper Table 4).
   Every teacher-supervised row has its own ledger and answer store (budget
   `max_queries`, sigma calibrated for epsilon); epsilon spent is read from
   it.

Evaluation on the private test set:
* PPL: exp of the mean token NLL over every token after BOS (EOS included).
* BLEU-3 / BLEU-4: each test prefix (its first 4 words) completed greedily;
  the completion (text after the prefix) scored against the reference
  completion with sacrebleu's corpus BLEU at `max_ngram_order` 3 / 4
  (defaults otherwise: 13a, exp smoothing).
* Name leakage (AirDialogue; paper App. O's R_name): the fraction of test
  completions whose generated text contains, as whole words, the full name
  of a user of the private training set.

Outputs in `output_dir/dataset/`: results.jsonl (one line per row and
seed), table1.md, table1.csv.
"""
from __future__ import annotations

import collections
import csv
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
import jax.numpy as jnp
import numpy as np
import sacrebleu
import tokenizers

from dpjax import decoding, fileio
from dpjax.models import gpt2, losses
from dpjax.seqpate import (accounting, aggregation, cache, partition,
                           pseudo_data, student, teachers)
from tasks import seqpate as data

DATASETS = ("airdialogue", "europarl")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a table depends on; the defaults run the embedded samples
  on a CPU in minutes (the paper: GPT-2 small, 2k teachers, 40 tokens)."""
  model: gpt2.GPT2Config = gpt2.GPT2Config(
      vocab_size=1255, n_positions=64, d_model=64, num_layers=2, num_heads=4,
      dropout_rate=0.0)
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


class Tokenizer:
  """The sample's byte-level BPE through `tokenizers` (no TensorFlow)."""

  def __init__(self, vocab_dir: str = data.DEFAULT_VOCAB_DIR):
    self._bpe = tokenizers.ByteLevelBPETokenizer(
        os.path.join(vocab_dir, "vocab.json"),
        os.path.join(vocab_dir, "merges.txt"))
    self.eos_id = self._bpe.token_to_id("<|endoftext|>")

  def encode(self, text: str) -> list[int]:
    return self._bpe.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._bpe.decode(list(ids))


def load_splits(dataset: str, settings: Settings, seed: int) -> dict:
  """{"private", "public", "test"}: lists of `tasks.seqpate.Completion`."""
  if dataset == "airdialogue":
    train = data.completion_examples(data.load_airdialogue("train"))
    users = sorted({e.user_id for e in train})
    order = np.random.default_rng(seed).permutation(len(users))
    public = {users[i] for i in
              order[:round(settings.public_fraction * len(users))]}
    return {"private": [e for e in train if e.user_id not in public],
            "public": [e for e in train if e.user_id in public],
            "test": data.completion_examples(data.load_airdialogue("dev"))}
  if dataset == "europarl":
    f = settings.public_fraction, settings.test_fraction
    return data.split_examples(
        data.completion_examples(data.load_europarl()),
        {"public": f[0], "test": f[1], "private": 1 - f[0] - f[1]}, seed)
  raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def save_params(path: str, params) -> None:
  with fileio.open_atomic(path, "wb") as f:
    f.write(flax.serialization.to_bytes(params))


def load_params(path: str, config: gpt2.GPT2Config, length: int):
  template = gpt2.init_params(config, jax.random.key(0), max_length=length)[0]
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
def _make_nll(config: gpt2.GPT2Config) -> Callable:
  model = gpt2.GPT2(config)

  def nll(params, tokens, weights):
    logits = model.apply({"params": params}, tokens)[:, :-1]
    return (losses.token_cross_entropy(logits, tokens[:, 1:])
            * weights[:, 1:]).sum()

  return jax.jit(nll)


def perplexity(config: gpt2.GPT2Config, params, arrays: dict,
               batch_size: int = 64) -> float:
  """exp(mean NLL) over the tokens with nonzero loss weight."""
  nll = _make_nll(config)
  tokens, weights = arrays["tokens"], arrays["loss_weights"]
  pad = -len(tokens) % batch_size
  tokens = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)])
  weights = np.concatenate([weights, np.zeros((pad,) + weights.shape[1:],
                                              weights.dtype)])
  total = sum(float(nll(params, tokens[i:i + batch_size],
                        weights[i:i + batch_size]))
              for i in range(0, len(tokens), batch_size))
  return math.exp(total / weights.sum())


def complete(config: gpt2.GPT2Config, params, arrays: dict,
             tokenizer: Tokenizer, *, batch_size: int = 64) -> list[str]:
  """Greedy completions of each row's prefix (`prefix_lengths`), decoded up
  to the first EOS."""
  lengths = arrays["prefix_lengths"]
  width = int(lengths.max())
  prompts = arrays["tokens"][:, :width]
  max_new = arrays["tokens"].shape[1] - int(lengths.min())
  pad = -len(prompts) % batch_size
  prompts = np.concatenate([prompts, np.repeat(prompts[-1:], pad, 0)])
  lengths = np.concatenate([lengths, np.repeat(lengths[-1:], pad)])
  out = np.concatenate([np.asarray(decoding.generate_causal(
      config, params, prompts[i:i + batch_size], lengths[i:i + batch_size],
      max_new_tokens=max_new, rng=None, greedy=True,
      eos_id=tokenizer.eos_id)) for i in range(0, len(prompts), batch_size)])
  texts = []
  for row in out[:len(out) - pad]:
    eos = np.flatnonzero(row == tokenizer.eos_id)
    texts.append(tokenizer.decode(row[:eos[0] if len(eos) else len(row)])
                 .strip())
  return texts


def bleu(hypotheses: Sequence[str], references: Sequence[str],
         order: int) -> float:
  """sacrebleu corpus BLEU (0-100) up to `order`-grams, one reference each."""
  return sacrebleu.BLEU(max_ngram_order=order).corpus_score(
      list(hypotheses), [list(references)]).score


def name_leakage(generated: Sequence[str], names: Sequence[str]) -> float:
  """Fraction of `generated` texts containing one of `names` (whole words,
  case-sensitive)."""
  if not names:
    raise ValueError("no names to look for.")
  pattern = re.compile(r"\b(?:" + "|".join(
      re.escape(n) for n in sorted(set(names), key=len, reverse=True))
      + r")\b")
  return float(np.mean([bool(pattern.search(t)) for t in generated]))


def evaluate(config: gpt2.GPT2Config, params, test: dict,
             tokenizer: Tokenizer, names: Sequence[str] | None) -> dict:
  """PPL, BLEU-3/4 and (with `names`) name leakage on the test set."""
  generated = complete(config, params, test["arrays"], tokenizer)
  row = {"ppl": perplexity(config, params, test["arrays"]),
         "bleu3": bleu(generated, test["references"], 3),
         "bleu4": bleu(generated, test["references"], 4)}
  if names:
    row["name_leakage"] = name_leakage(generated, names)
  row["samples"] = [{"prefix": p, "generated": g}
                    for p, g in zip(test["prefixes"][:5], generated[:5])]
  return row


# Rows: name -> (kind, student/aggregator options).
def table_rows(settings: Settings) -> dict[str, tuple[str, dict]]:
  rows = {"Pub-GPT": ("public", {}),
          "Pub-GPT+D^pub": ("warmup", {}),
          "Pri-GPT (no DP)": ("private", {}),
          "SeqPATE": ("student", {}),
          "-Merge_P (no candidate filter)": (
              "student", {"top_p": 1.0, "max_candidates":
                          settings.model.vocab_size}),
          "-KL (teacher top-1 CE)": ("student", {"distill": "top1"}),
          "-Gaussian (no noise, eps=inf)": ("student", {"noise": False})}
  for k in settings.top_k_rows:
    rows[f"filter top-k={k}"] = ("student", {"top_p": 1.0, "top_k": k,
                                             "max_candidates": max(
                                                 k, settings.max_candidates)})
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
  root = os.path.join(os.path.abspath(output_dir), dataset)
  os.makedirs(root, exist_ok=True)
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
    splits["private"] = splits["private"][:settings.max_examples]
    splits["public"] = splits["public"][:settings.max_examples]
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

    init = gpt2.init_params(config, jax.random.key(seed), max_length=length)[0]
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
    warm = model("warmup", lambda: train_lm(
        config, public, pseudo, epochs=settings.student.warmup_epochs,
        learning_rate=settings.student.learning_rate,
        batch_size=settings.student.batch_size, seed=seed, log=log))
    sums = None
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
        params = warm
      elif kind == "private":
        params = model("pri_gpt", lambda: train_lm(
            config, public, arrays["private"], epochs=settings.private_epochs,
            learning_rate=settings.private_learning_rate,
            batch_size=settings.batch_size, seed=seed, log=log))
        privacy = {"epsilon_spent": math.inf, "queries": 0}
      else:
        if sums is None:
          sums = _teacher_sums(run_dir, settings, config, public,
                               arrays["private"], splits["private"], pseudo,
                               seed, log)
        params, privacy = _distill(row_dir, settings, config, warm, pseudo,
                                   sums, len(splits["private"]), options,
                                   seed, log)
      row = {"row": name, "dataset": dataset, "seed": seed, **privacy,
             **evaluate(config, params, test, tokenizer, names),
             "seconds": round(time.time() - t, 1)}
      _write_json(scores_path, row)
      log(f"[{dataset} seed {seed}] {name}: ppl {row['ppl']:.2f}, bleu3 "
          f"{row['bleu3']:.2f}, bleu4 {row['bleu4']:.2f}"
          + (f", name leakage {row['name_leakage']:.4f}" if names else ""))
      results.append(row)
  return _write_table(root, results, dataset, settings)


def _teacher_sums(run_dir, settings, config, public, private_arrays,
                  private_examples, pseudo, seed, log):
  n = len(private_examples)
  if settings.partition == "sample":
    assignment = partition.sample_partition(n, settings.num_teachers, seed)
  elif settings.partition == "user":
    assignment = partition.user_partition(
        [e.user_id for e in private_examples], settings.num_teachers, seed)
  else:
    raise ValueError(f"partition must be 'sample' or 'user', got "
                     f"{settings.partition!r}")
  cache_dir = os.path.join(run_dir, f"teachers_{settings.partition}")
  t = time.time()
  setup = dataclasses.replace(settings.teacher, seed=seed)
  mesh = teachers.teacher_mesh(jax.devices()[:1]) if (
      setup.group_size % len(jax.devices())) else None
  teachers.train_and_cache(config, public, private_arrays["tokens"],
                           private_arrays["loss_weights"], assignment,
                           pseudo["tokens"], cache_dir, setup, mesh=mesh,
                           log=log)
  sums = cache.TeacherSums.from_cache(
      cache_dir, settings.num_teachers,
      pseudo_fingerprint=cache.fingerprint(pseudo["tokens"]))
  log(f"teachers ({settings.num_teachers}, {settings.partition}-level): "
      f"{time.time() - t:.0f}s")
  return sums


def _distill(row_dir, settings, config, warm, pseudo, sums, n_private,
             options, seed, log):
  """The KD phase of one row from the warm-up student; returns (params,
  privacy)."""
  options = dict(options)
  noise = options.pop("noise", True)
  width = options.pop("max_candidates", settings.max_candidates)
  setup = dataclasses.replace(settings.student, warmup_epochs=0, seed=seed,
                              **options)
  if os.path.isfile(os.path.join(row_dir, aggregation.ANSWERS_FILENAME)):
    agg = aggregation.Aggregator.restore(row_dir, sums, seed=seed,
                                         max_candidates=width)
  else:
    ledger = accounting.make_ledger(
        settings.epsilon if noise else math.inf, settings.max_queries,
        num_teachers=settings.num_teachers, dataset_size=n_private,
        sigma=None if noise else 0.0)
    agg = aggregation.Aggregator(sums, ledger, seed=seed,
                                 max_candidates=width)
  kd = student.Student(config, warm, pseudo, setup)
  stats = kd.distill(agg, log)
  agg.save(row_dir)
  return kd.params, {
      "epsilon_spent": agg.ledger.epsilon_spent(),
      "delta": agg.ledger.delta, "sigma": agg.sigma,
      "queries": int(sum(e.count for e in agg.ledger.events)),
      "max_queries": agg.max_queries,
      "distilled_positions": stats.distilled_positions}


def _cell(values: list[float], digits: int = 2) -> str:
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def _write_table(root: str, rows: list[dict], dataset: str,
                 settings: Settings) -> dict:
  fileio.write_atomic(os.path.join(root, "results.jsonl"), "".join(
      json.dumps(r) + "\n" for r in rows))
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault(r["row"], []).append(r)
  metrics = ["ppl", "bleu3", "bleu4"] + (
      ["name_leakage"] if "name_leakage" in rows[0] else [])
  header = ["method", "PPL", "BLEU-3", "BLEU-4"] + (
      ["name leakage %"] if "name_leakage" in metrics else []) + [
          "ε spent", "queries", "seeds"]
  lines = [f"# SeqPATE on {dataset}: Table 1 and ablations (target ε = "
           f"{settings.epsilon:g}, δ = {accounting.DELTA:g}, "
           f"{settings.num_teachers} teachers, {settings.partition}-level, "
           f"budget {settings.max_queries} queries)", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  table = []
  for name, group in groups.items():
    cells = [name] + [_cell([g[m] * (100 if m == "name_leakage" else 1)
                             for g in group]) for m in metrics]
    spent = max(g["epsilon_spent"] for g in group)
    cells += [f"{spent:.3f}" if math.isfinite(spent) else "∞",
              str(max(g["queries"] for g in group)), str(len(group))]
    lines.append("| " + " | ".join(cells) + " |")
    table.append(dict(zip(header, cells)))
  lines += ["", "PPL on the private test sentences; BLEU-n (sacrebleu, "
            "0-100) of greedy completions of the test prefixes; name leakage: "
            "completions naming a private training user. mean ± std over "
            "seeds. Pub-GPT and Pub-GPT+D^pub use no private data (ε 0); "
            "Pri-GPT is trained on it without privacy (ε ∞)."]
  md = os.path.join(root, "table1.md")
  fileio.write_atomic(md, "\n".join(lines) + "\n")
  with fileio.open_atomic(os.path.join(root, "table1.csv")) as f:
    writer = csv.DictWriter(f, fieldnames=header)
    writer.writeheader()
    writer.writerows(table)
  return {"table_md": md, "rows": rows}
