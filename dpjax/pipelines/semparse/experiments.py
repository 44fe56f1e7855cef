"""The paper's experiments (Mireshghallah et al., ACL 2023, arXiv 2212.10520),
one function each.

`generation_table`: Table 1 (and Table 6's top-k coverage). DP synthetic
utterances by three methods, scored against the human test utterances:

* 1-stage: a DP GPT-2 utterance LM, sampled unconditionally.
* 1.5-stage (TreeDST): a DP domain -> utterance LM, prompted with domains
  drawn from the training set's domain distribution (public, as in the
  paper).
* 2-stage: a DP parse LM (T1 epochs) and a DP parse -> utterance LM (T2
  epochs) trained with ONE noise multiplier σ calibrated for T1 + T2 epochs
  at the same sampling rate; the second run's ledger composes with the
  first's (`train.prior_ledger`), so the reported ε is that of both. Parses
  are sampled with 1 beam, utterances with 5 (multinomial beam search).

The 1-stage and 1.5-stage LMs train for T1 + T2 epochs, the same number of
DP steps as the 2-stage pipeline. Parse metrics use a high-resource parser
(T5 trained without DP on the full training set) on the synthetic
utterances, against the gold programs of the test utterances; MAUVE uses
features from a GPT-2 trained without DP on the training utterances (or any
GPT-2 run given as `feature_model_dir`). All runs are resumable: rerunning the
same command skips finished trainings, generations and scores.
"""
from __future__ import annotations

import collections
import json
import math
import os
from typing import Iterable, Sequence

import numpy as np

from dpjax import configurables, fileio, verify
from dpjax.pipelines import harness
from dpjax.training import plan as plan_lib
from dpjax.training import run_config as run_config_lib
from dpjax.data.readers import semparse
from dpjax.pipelines.semparse import pipeline
from tasks import semparse as semparse_tasks

METHODS = ("1-stage", "1.5-stage", "2-stage")
EPSILONS = (3.0, 8.0, 16.0, math.inf)
METRICS = ("word_overlap", "mauve", "chi2_distance", "function_overlap")
# Sequence lengths (BPE tokens) of the decoder-only tasks on the samples: the
# longest prompt + target there is 108 tokens.
FEATURE_LENGTHS = {
    "utterance_lm": {"inputs": 1, "targets": 40},
    "domain_to_utterance": {"inputs": 8, "targets": 40},
    "parse_lm": {"inputs": 1, "targets": 112},
    "parse_to_utterance": {"inputs": 112, "targets": 40},
}


def _read_json(path):
  with open(path) as f:
    return json.load(f)


class _Runs:
  """Trains the GPT-2 runs of one experiment with shared gin settings and
  RunConfig `fields`."""

  def __init__(self, gin_files, bindings, lengths, fields=None):
    self.gin_files, self.bindings, self.lengths = gin_files, bindings, lengths
    self.fields = dict(fields or {})

  def train(self, model_dir, task, kind, eps, seed, steps, **fields):
    """Trains (or resumes) one run: these RunConfig fields over the shared
    gin settings."""
    return harness.train_run(model_dir, self.gin_files, self.bindings, **{
        "mixture_or_task_name": task,
        "task_feature_lengths": self.lengths[kind], "target_epsilon": eps,
        "epochs": None, "train_steps": steps, "seed": seed, **self.fields,
        **fields})

  def with_bindings(self, *extra, **fields) -> "_Runs":
    return _Runs(self.gin_files, (*self.bindings, *extra), self.lengths,
                 {**self.fields, **fields})

  def run_config(self) -> run_config_lib.RunConfig:
    """The runs' settings as these gin files, bindings and fields
    configure them."""
    return harness.configured(lambda: configurables.run_config(**self.fields),
                              self.gin_files, self.bindings)

  def data_config(self) -> semparse_tasks.SemparseConfig:
    """The runs' task settings (data directories, portions)."""
    return harness.configured(semparse_tasks.SemparseConfig, self.gin_files,
                              self.bindings)

  def stage_steps(self, n: int, epochs: tuple[float, float]
                  ) -> tuple[int, int]:
    """(T1, T2): the DP steps of `epochs` on n examples at the gin's
    batch."""
    batch = int(self.run_config().batch_size)
    t1, t2 = (math.ceil(e * n / batch) for e in epochs)
    return t1, t2

  def stages_sigma(self, n: int, steps: tuple[int, int], eps: float,
                   delta: float | None = None) -> float:
    """The one σ for T1 + T2 steps under the gin's sampler and accountant
    (`plan.stages_plan`) on n examples at ε (δ = 1/(2n) unless DELTA or
    `delta` is set)."""
    return plan_lib.stages_plan(self.run_config(), n, steps, eps, delta)[1]


def _sample_lengths(lengths: dict, max_tokens: dict | None) -> dict:
  """Most tokens sampled per utterance and per parse: `max_tokens`, else
  the utterance and parse LMs' target lengths."""
  return dict({"utterance": lengths["utterance_lm"]["targets"],
               "parse": lengths["parse_lm"]["targets"]}, **(max_tokens or {}))


def _synthesize(runs: _Runs, run_dir: str, method: str, dataset: str,
                eps: float, seed: int, *, num: int, n: int,
                steps: tuple[int, int], delta: float | None = None,
                domains: Sequence[str], max_tokens: dict
                ) -> tuple[list[str], dict]:
  """Trains one method's models at (ε, seed) on n examples and samples `num`
  utterances. The 2-stage σ (one for both stages) is searched for only
  here, when its runs train: a finished method needs none, and a 1-stage
  or 1.5-stage run calibrates its own."""
  out = os.path.join(run_dir, "synthetic.jsonl")
  if os.path.isfile(out):
    rows = [json.loads(line) for line in open(out)]
    return [r["utterance"] for r in rows], rows[0]["privacy"] if rows else {}
  t1, t2 = steps
  rng = np.random.default_rng(seed)
  gen = dict(seed=seed, max_new_tokens=max_tokens["utterance"])
  if method == "2-stage":
    fixed = {} if math.isinf(eps) else {
        "noise_multiplier": runs.stages_sigma(n, steps, eps, delta)}
    parse_dir = os.path.join(run_dir, "parse_lm")
    utt_dir = os.path.join(run_dir, "parse_to_utterance")
    runs.train(parse_dir, f"{dataset}_parse_lm", "parse_lm", eps, seed, t1,
               **fixed)
    runs.train(utt_dir, f"{dataset}_parse_to_utterance", "parse_to_utterance",
               eps, seed, t2, prior_ledger=parse_dir, **fixed)
    parses = pipeline.generate_texts(
        parse_dir, [""] * num, num_beams=1, seed=seed,
        max_new_tokens=max_tokens["parse"])
    prompts = [semparse_tasks.parse_prompt(p) for p in parses]
    utterances = pipeline.generate_texts(utt_dir, prompts, num_beams=5, **gen)
    final_dir = utt_dir
  else:
    kind = "utterance_lm" if method == "1-stage" else "domain_to_utterance"
    final_dir = os.path.join(run_dir, kind)
    runs.train(final_dir, f"{dataset}_{kind}", kind, eps, seed, t1 + t2)
    prompts = ([""] * num if method == "1-stage" else
               [semparse_tasks.domain_prompt(d) for d in rng.choice(domains, num)])
    utterances = pipeline.generate_texts(final_dir, prompts, num_beams=5,
                                         **gen)
  ledger = verify.run_ledger(final_dir)
  privacy = {"epsilon_spent": ledger.epsilon_spent(), "delta": ledger.delta,
             "noise_multiplier": ledger.noise_multiplier,
             "dp_steps": t1 + t2}
  fileio.write_atomic(out, "".join(
      json.dumps({"prompt": p, "utterance": u, "privacy": privacy}) + "\n"
      for p, u in zip(prompts, utterances)))
  return utterances, privacy


def generation_table(out_dir: str, *, dataset: str = "treedst",
                     methods: Sequence[str] | None = None,
                     epsilons: Iterable[float] = EPSILONS,
                     seeds: Iterable[int] = (0,),
                     epochs: tuple[float, float] = (2, 8),
                     gin_files: Sequence[str] = ("semparse_sample.gin",),
                     bindings: Sequence[str] = (),
                     parser_gin_files: Sequence[str] = ("semparse_t5_parser.gin",),
                     parser_bindings: Sequence[str] = (),
                     feature_model_dir: str | None = None,
                     feature_lengths: dict | None = None,
                     num_samples: int | None = None,
                     max_tokens: dict | None = None) -> dict:
  """Runs Table 1 for `dataset`; writes results.jsonl, table1.{md,csv}.

  Args:
    out_dir: everything goes here (one run directory per model).
    dataset: "smcalflow" or "treedst".
    methods: subset of METHODS (1.5-stage needs TreeDST's domains); default:
      all that apply.
    epsilons, seeds: the grid (ε = inf trains without noise); the paper
      averages three seeds (0, 1, 2), each about 26 minutes more here.
    epochs: (T1, T2): parse-LM and parse->utterance epochs of the 2-stage
      method; the other methods train for T1 + T2 epochs.
    gin_files, bindings: GPT-2 training settings (`gin/semparse_sample.gin`
      on the embedded samples, `gin/semparse_gpt2.gin` for the paper's).
    parser_gin_files, parser_bindings: the high-resource T5 parser.
    feature_model_dir: a GPT-2 run for MAUVE features (default: trained here
      without DP on the training utterances).
    num_samples: synthetic utterances per run (default: as many as the
      human test utterances, as in the paper).
  """
  methods = tuple(methods or [m for m in METHODS if dataset == "treedst"
                              or m != "1.5-stage"])
  if dataset != "treedst" and "1.5-stage" in methods:
    raise ValueError("1.5-stage needs domain labels: TreeDST only")
  lengths = dict(FEATURE_LENGTHS, **(feature_lengths or {}))
  max_tokens = _sample_lengths(lengths, max_tokens)
  root = os.path.join(os.path.abspath(out_dir), dataset)
  runs = _Runs(tuple(gin_files), tuple(bindings), lengths)

  # All methods train on the same n examples, for the same steps at every ε.
  train_turns = semparse.load_turns(dataset, "train")
  n = len(train_turns)
  t1, t2 = runs.stage_steps(n, epochs)
  domains = [t.domain or semparse.UNKNOWN_DOMAIN for t in train_turns]

  # Evaluation models, trained once without DP.
  parser_dir = os.path.join(root, "parser_full")
  harness.train_run(parser_dir, parser_gin_files, parser_bindings,
                    mixture_or_task_name=f"{dataset}_parser")
  if feature_model_dir is None:
    feature_model_dir = os.path.join(root, "feature_lm")
    runs.train(feature_model_dir, f"{dataset}_utterance_lm", "utterance_lm",
               math.inf, 0, t1 + t2)
  test = semparse.load_turns(dataset, "validation")
  human = [t.utterance for t in test]
  human_types = [list(t.function_types) for t in test]
  human_features = pipeline.lm_features(feature_model_dir, human)
  num = num_samples or len(human)

  def scored(name, utterances):
    path = os.path.join(root, name, "scores.json")
    if os.path.isfile(path):
      return _read_json(path)
    parses = pipeline.parse_utterances(parser_dir, utterances)
    row = pipeline.score(
        utterances, [pipeline.function_types_or_none(p) for p in parses],
        human, human_types,
        synthetic_features=pipeline.lm_features(feature_model_dir, utterances),
        human_features=human_features)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fileio.write_atomic(path, json.dumps(row, indent=2))
    return row

  rows = [dict(method="ground truth", epsilon=None, seed=None,
               **scored("ground_truth", human))]
  for eps in epsilons:
    for method in methods:
      for seed in seeds:
        name = os.path.join(method, f"eps{harness.eps_name(eps)}", f"seed{seed}")
        utterances, privacy = _synthesize(
            runs, os.path.join(root, name), method, dataset, eps, seed,
            num=num, n=n, steps=(t1, t2), domains=domains,
            max_tokens=max_tokens)
        rows.append(dict(method=method, epsilon=eps, seed=seed, **privacy,
                         **scored(name, utterances)))
  return _write_table(root, rows, dataset)


def _write_table(root: str, rows: list[dict], dataset: str) -> dict:
  harness.write_results(os.path.join(root, harness.RESULTS_FILENAME), rows)
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault((r["method"], r["epsilon"]), []).append(r)
  coverage = sorted((k for k in rows[0] if k.startswith("top")),
                    key=lambda k: int(k[3:].split("_")[0]))
  header = ["ε", "method", *METRICS, *coverage, "ε spent", "seeds"]
  table = []
  for (method, eps), group in groups.items():
    cells = [("–" if eps is None else harness.eps_name(eps)), method]
    cells += [harness.mean_std([g[m] for g in group], digits=3)
              for m in (*METRICS, *coverage)]
    spent = [g["epsilon_spent"] for g in group if "epsilon_spent" in g]
    cells += [f"{max(spent):.3f}" if spent else "–", str(len(group))]
    table.append(cells)
  md = os.path.join(root, "table1.md")
  text = harness.write_table(
      table, header, md, os.path.join(root, "table1.csv"),
      title=f"{dataset}: DP synthetic utterances (paper Table 1 / Table 6)",
      notes=["Word and function overlap, MAUVE and top-k coverage: higher "
             "is better; χ² distance: lower is better. mean ± std over "
             "seeds."])
  plot = os.path.join(root, "mauve_vs_epsilon.png")
  truth = groups.get(("ground truth", None))
  harness.plot_vs_epsilon(
      {method: {e: _mean([g["mauve"] for g in group])
                for (m, e), group in groups.items() if m == method}
       for method in dict.fromkeys(m for m, e in groups if e is not None)},
      plot, "MAUVE", title=f"{dataset}: DP synthetic utterances",
      references={"human test utterances": truth[0]["mauve"]}
      if truth and truth[0].get("mauve") is not None else {})
  print(text, end="", flush=True)
  return {"table_md": md, "rows": rows, "plot": plot}


def _mean(values) -> float | None:
  """The mean over seeds of the values that exist; None if none does."""
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def adaptation_table(out_dir: str, *, dataset: str = "smcalflow",
                     missing: str = "weather", epsilon: float = 3.0,
                     seed: int = 0, methods: Sequence[str] = ("1-stage",
                                                              "2-stage"),
                     epochs: tuple[float, float] = (2, 8),
                     gin_files: Sequence[str] = ("semparse_sample.gin",),
                     bindings: Sequence[str] = (),
                     parser_gin_files: Sequence[str] = ("semparse_t5_parser.gin",),
                     public_parser_gin_files: Sequence[str] = (
                         "semparse_t5_parser_public.gin",),
                     parser_bindings: Sequence[str] = (),
                     num_synthetic: int | None = None,
                     feature_lengths: dict | None = None,
                     max_tokens: dict | None = None,
                     test_portion: str = "all") -> dict:
  """The domain-adaptation experiment (paper Sec. 5.4, Table 3).

  D_pub = the public 1/10 of the training set without the `missing`
  functionality (`tasks.semparse.PAPER_EXCLUSIONS`: "weather" or "eod");
  D_priv = the other 9/10, whose programs are not used. A low-resource
  parser p0 trained on D_pub (`public_parser_gin_files`: by default 10x the
  epochs of the full parser, so both take as many steps) parses D_priv. The
  DP generators are trained on D_priv at `epsilon`: the 1-stage utterance LM
  on all its utterances; the 2-stage parse and parse -> utterance LMs on the
  utterances whose p0 parse is valid Lispress, with p0's parses.
  `num_synthetic` utterances (default |D_priv|; `max_tokens` caps their
  and the sampled parses' tokens, default the tasks' target lengths) are
  sampled, labelled by the high-resource parser (trained on the full
  training set, standing in for annotators) and added to D_pub; the parser
  retrained on D_pub ∪ D_s is compared with p0 on the test split (the
  validation file; `test_portion="public"` takes the paper's 1/10
  subsample): exact match and API precision/recall overall and on the test
  examples that use the missing functionality. Writes table3.md and
  results.json under `out_dir/<dataset>_adaptation`.

  Privacy: each D_priv utterance is one training example of each generator
  (at most one row: dropping an invalid parse is a function of that
  utterance and the public p0 alone), and both generators are (ε, δ)-DP
  with δ = 1/(2|D_priv|) unless DELTA is set. As usual in DP-SGD, the
  training-set sizes (|D_priv|, and the number of valid parses that sets
  the 2-stage sampling rate) are treated as public.
  """
  root = os.path.join(os.path.abspath(out_dir), f"{dataset}_adaptation")
  focus = semparse.PAPER_EXCLUSIONS[missing]
  lengths = dict(FEATURE_LENGTHS, **(feature_lengths or {}))
  runs = _Runs(tuple(gin_files), tuple(bindings), lengths)
  parser = lambda model_dir, files, task, *extra: harness.train_run(
      model_dir, files, [*parser_bindings, *extra], mixture_or_task_name=task)
  data_flag = f"register_semparse_tasks.{dataset}_dir"

  # Parsers trained on the published data: p0 (public, functionality
  # removed) and the high-resource one (everything).
  p0_dir = os.path.join(root, "parser_public")
  parser(p0_dir, public_parser_gin_files, f"{dataset}_parser",
         "register_semparse_tasks.parser_portion = 'public'",
         f"register_semparse_tasks.parser_exclude_functions = {list(focus)!r}")
  full_dir = os.path.join(root, "parser_full")
  parser(full_dir, parser_gin_files, f"{dataset}_parser")
  # The data directory the user pointed the runs at (default: the sample).
  source = (runs.data_config().data_dir(dataset)
            or semparse.DEFAULT_DATA_DIRS[dataset])
  valid_file = semparse.split_path(source, "validation")
  private = semparse.select_portion(
      semparse.load_turns(dataset, "train", source), "private")

  # D_priv with p0's parses (invalid parses dropped), as dataflow files.
  priv_dir = os.path.join(root, "private_predicted")
  priv_train = os.path.join(priv_dir, semparse.SPLIT_FILES["train"])
  if not os.path.isfile(priv_train):
    predicted = pipeline.parse_utterances(p0_dir,
                                          [t.utterance for t in private])
    pairs = [(t.utterance, p) for t, p in zip(private, predicted)
             if pipeline.function_types_or_none(p) is not None]
    os.makedirs(priv_dir, exist_ok=True)
    with open(valid_file) as f:
      fileio.write_atomic(os.path.join(priv_dir, semparse.SPLIT_FILES[
          "validation"]), f.read())
    semparse.write_dialogues(priv_train, pairs, prefix="private")
  num_parsed = len(semparse.load_turns(dataset, "train", priv_dir))
  delta = runs.run_config().delta or 1.0 / (2 * len(private))
  method_runs = {  # each generator's training data: n examples, bindings
      "1-stage": (len(private), runs.with_bindings(
          f"{data_flag} = '{source}'",
          "register_semparse_tasks.lm_portion = 'private'", delta=delta)),
      "2-stage": (num_parsed, runs.with_bindings(
          f"{data_flag} = '{priv_dir}'", delta=delta)),
  }
  unknown = set(methods) - set(method_runs)
  if unknown:
    raise ValueError(f"adaptation methods are {sorted(method_runs)}, got "
                     f"{sorted(unknown)}")
  batch = int(runs.run_config().batch_size)
  if "2-stage" in methods and batch > num_parsed:
    raise ValueError(
        f"the low-resource parser {p0_dir} parsed only {num_parsed} of "
        f"{len(private)} D_priv utterances validly, fewer than BATCH_SIZE = "
        f"{batch}: train it longer (--parser_gin.EPOCHS=...) or lower "
        "--gin.BATCH_SIZE")

  test = semparse.select_portion(
      semparse.load_turns(dataset, "validation", source), test_portion)
  gold = [t.program for t in test]
  rows = {}

  def evaluate(name, parser_dir):
    rows[name] = pipeline.parser_scores(
        pipeline.parse_utterances(parser_dir, [t.utterance for t in test]),
        gold, focus)

  evaluate("D_pub (p0)", p0_dir)
  public = semparse.drop_functions(semparse.select_portion(
      semparse.load_turns(dataset, "train", source), "public"), focus)
  for method in methods:
    n, method_run = method_runs[method]
    run_dir = os.path.join(root, method)
    utterances, privacy = _synthesize(
        method_run, run_dir, method, dataset, epsilon, seed,
        num=num_synthetic or len(private), n=n,
        steps=method_run.stage_steps(n, epochs), delta=delta, domains=[],
        max_tokens=_sample_lengths(lengths, max_tokens))
    aug_dir = os.path.join(run_dir, "augmented_data")
    if not os.path.isfile(os.path.join(aug_dir, semparse.SPLIT_FILES["train"])):
      labels = pipeline.parse_utterances(full_dir, utterances)
      synthetic = [(u, p) for u, p in zip(utterances, labels)
                   if u and pipeline.function_types_or_none(p) is not None]
      os.makedirs(aug_dir, exist_ok=True)
      with open(valid_file) as f:
        fileio.write_atomic(os.path.join(aug_dir, semparse.SPLIT_FILES[
            "validation"]), f.read())
      semparse.write_dialogues(
          os.path.join(aug_dir, semparse.SPLIT_FILES["train"]),
          [(t.utterance, t.program) for t in public] + synthetic,
          prefix=f"{method}-augmented")
    aug_parser = os.path.join(run_dir, "parser_augmented")
    parser(aug_parser, parser_gin_files, f"{dataset}_parser",
           f"{data_flag} = '{aug_dir}'")
    name = f"D_pub + D_s ({method}, ε={harness.eps_name(epsilon)})"
    evaluate(name, aug_parser)
    rows[name].update(epsilon_spent=privacy["epsilon_spent"],
                      generator_examples=n)
  evaluate("full training set (high-resource)", full_dir)

  cols = ["exact_match", "api_precision", "api_recall"]
  header = ["parser training data", *[f"{missing} {c}" for c in cols],
            *[f"all {c}" for c in cols], "ε spent"]
  table = [[name, *(f"{r['focus_' + c]:.3f}" for c in cols),
            *(f"{r[c]:.3f}" for c in cols),
            f"{r['epsilon_spent']:.3f}" if "epsilon_spent" in r else "–"]
           for name, r in rows.items()]
  md = os.path.join(root, "table3.md")
  text = harness.write_table(
      table, header, md,
      title=f"{dataset}: adding '{missing}' from DP synthetic data "
            "(paper Table 3)",
      notes=[f"Test: {len(test)} utterances of the validation file "
             f"({rows['D_pub (p0)']['focus_examples']} use '{missing}'). "
             f"D_pub: {len(public)} examples; D_priv: {len(private)} "
             f"utterances, {num_parsed} with a valid p0 parse (the 2-stage "
             "generators' data; the 1-stage LM trains on all)."])
  fileio.write_atomic(os.path.join(root, "results.json"),
                      json.dumps(rows, indent=2))
  print(text, end="", flush=True)
  return {"table_md": md, "rows": rows}
