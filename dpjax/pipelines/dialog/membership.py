"""User-level membership inference against dialog LMs: LiRA (Carlini et al.,
"Membership Inference Attacks From First Principles", S&P 2022), the
empirical check of a user-level guarantee.

The claim of `train.privacy_unit = 'user'` at (ε, δ): whatever test decides
whether one user's conversations were in the training set, its true- and
false-positive rates satisfy TPR <= e^ε FPR + δ. Example-level DP at the same
ε makes that claim for one chunk only; a user of c chunks is covered by group
privacy at about c ε. LiRA is the strongest practical test of the claim.

Design (Carlini et al.'s online attack, leave-one-model-out):

1. `membership_splits`: M models; each user is IN for exactly M / 2 of them,
   chosen uniformly, so each model trains on about half of the users.
2. Each model is one trainer run of the same gin (per privacy setting), with
   `register_multidogo_tasks.train_conversations_path` naming its users.
3. `user_scores`: the statistic of user u under model m is minus the mean
   per-token NLL of all of u's training chunks.
4. `lira_scores`: each model's scores are first centred on their mean over
   all users: models differ in overall fit (their random starts, their
   halves' step counts), a shift shared by all users that would otherwise
   swamp the per-user signal (on the embedded sample it takes the AUC
   against non-private models from 0.67 to 0.48). Then each model in turn
   is the target and the other M - 1 its shadows:
   Λ(m, u) = log N(s; μ_in(u), σ_in²) - log N(s; μ_out(u), σ_out²),
   with per-user means over the shadows where u was IN / OUT, and variances
   pooled over all users (the paper's fixed-variance variant, the stable one
   with few shadows).
5. `attack_metrics`: AUC and TPR at 1% and 10% FPR over all (model, user)
   pairs, each labelled by whether u trained m.
6. `epsilon_bounds`: jax-privacy's one-run ε estimators on the same pairs
   (`dpjax.audit.scores.lower_bound`, Λ the score, membership the coin):
   `epsilon_lower_bound` (Mahloujifar et al., "Auditing f-Differential
   Privacy in One Run", arXiv 2410.22235) and `epsilon_one_run` (Steinke,
   Nasr and Jagielski, "Privacy Auditing with One (1) Training Run",
   NeurIPS 2023, arXiv 2305.08846), at `CONFIDENCE` and at one δ for every
   setting (`bound_delta`): the user-level runs' ledger δ, i.e. the gin's
   `train.delta` resolved for the users a model trains on (1/(2n) by
   default), the largest over the models. The example-level and
   non-private rows are stated at that δ too, not at their own ledgers'
   (which count chunks, not users), so the rows compare with each other and
   with the retrieval canaries' one-run bound
   (`dpjax.pipelines.retrieval.canaries.one_run_bounds`).

Limits of the ε figure. The one-run theorem (and its f-DP refinement)
bounds the ε of ONE training run from a score of its output alone and
canaries each included by an independent fair coin. Here the pairs come
from M runs; a user's M coins are tied (exactly M / 2 IN, so the shadows'
coins, which Λ reads, determine the target's); and Λ of a target is built
from the other models. The figure is therefore a statistic computed the
same way for every setting and experiment, comparable between them, not a
certified lower bound of any model's ε. (The tie biases Λ against the
attack: without leakage a target's IN mean has one shadow fewer than its
OUT mean, so IN pairs score lower on average; on scores with no member
signal the AUC is about 0.41 at M = 4 and 0.47 at M = 8.)

Cost: M trainings per setting; scoring is one forward pass per model over
the train and validation splits. No TensorFlow here but in `run` (the data
layer, imported lazily). Bad settings, model counts or a gin that is not
user-level are `errors.UsageError`s, raised before anything is written.
"""
from __future__ import annotations

import json
import math
import os
from typing import Mapping, Sequence

import numpy as np
from sklearn import metrics as sk_metrics

import tasks
from dpjax import configurables, errors, fileio
from dpjax.audit import scores as audit_scores
from dpjax.pipelines import harness
from dpjax.generation import inference
from dpjax.models import gpt2
from dpjax.training import plan as plan_lib

FPRS = (0.01, 0.1)
CONFIDENCE = 0.95  # of the ε bounds (`epsilon_bounds`)
SETTINGS = ("nonprivate", "example", "user")
LABELS = {"nonprivate": "non-private", "example": "example-level DP",
          "user": "user-level DP"}


def membership_splits(num_users: int, num_models: int,
                      rng: np.random.Generator) -> np.ndarray:
  """bool [M, U]: user u trains model m. Each column holds exactly M / 2
  True values, at positions uniform over the M-choose-M/2 subsets."""
  _check_model_count(num_models)
  order = np.argsort(rng.random((num_models, num_users)), axis=0)
  return order < num_models // 2


def _check_model_count(num_models: int) -> None:
  if num_models < 4 or num_models % 2:
    raise errors.UsageError(
        f"num_models must be even and >= 4 (each user needs >= 2 IN and OUT "
        f"shadows besides the target), got {num_models}")


def user_scores(nll_sums: np.ndarray, token_counts: np.ndarray,
                users: np.ndarray, user_ids: Sequence) -> np.ndarray:
  """float64 [U]: minus the mean NLL per token over each user's chunks
  (`nll_sums`, `token_counts`: [N] per chunk; `users`: [N] each chunk's
  user), in the order of `user_ids`."""
  index = {u: i for i, u in enumerate(user_ids)}
  rows = np.array([index[u] for u in users])
  sums = np.bincount(rows, nll_sums, minlength=len(user_ids))
  counts = np.bincount(rows, token_counts, minlength=len(user_ids))
  if (counts == 0).any():
    raise ValueError("a user has no scored token")
  return -sums / counts


def lira_scores(scores: np.ndarray, member: np.ndarray) -> np.ndarray:
  """float64 [M, U]: Λ of each (target model, user) from per-model centred
  scores, leave-one-model-out (see the module docstring); `scores` and
  `member` are [M, U]."""
  s, inn = np.asarray(scores, np.float64), np.asarray(member, bool)
  s = s - s.mean(1, keepdims=True)  # each model's overall fit

  def others(x):  # Σ over the models other than the target, per (m, u)
    return x.sum(0, keepdims=True) - x

  def mean_and_pooled_variance(group):
    """Per (target, user): the mean over the shadows in `group` (IN or
    OUT); per target: the variance about those means, pooled over users
    (unbiased: one degree of freedom per user mean)."""
    n = others(group.astype(float))
    mu = others(s * group) / n
    squares = others(s * s * group) - n * mu * mu  # Σ (x - mu)² per (m, u)
    return mu, squares.sum(1, keepdims=True) / (n - 1).sum(1, keepdims=True)

  mu_in, var_in = mean_and_pooled_variance(inn)
  mu_out, var_out = mean_and_pooled_variance(~inn)
  log_pdf = lambda x, mu, var: -0.5 * ((x - mu) ** 2 / var + np.log(var))
  return log_pdf(s, mu_in, var_in) - log_pdf(s, mu_out, var_out)


def attack_metrics(scores: np.ndarray, member: np.ndarray,
                   fprs: Sequence[float] = FPRS) -> dict:
  """AUC and TPR at each FPR of the LiRA statistic over all (model, user)
  pairs (higher Λ: more likely IN)."""
  y, x = np.asarray(member, bool).ravel(), np.asarray(scores).ravel()
  fpr, tpr, _ = sk_metrics.roc_curve(y, x, drop_intermediate=False)
  out = {"auc": float(sk_metrics.roc_auc_score(y, x)), "pairs": int(y.size)}
  for f in fprs:
    # The best TPR among thresholds with FPR <= f.
    out[f"tpr@{f:g}"] = float(tpr[fpr <= f].max())
  return out


def bound_delta(delta: float | str | None, member: np.ndarray) -> float:
  """The δ of every setting's ε bounds: `delta` (`train.delta` as the gin
  sets it) resolved for the users each model trains on (`member`: [M, U]),
  as the user-level runs' ledgers resolve it, the largest over the models.
  An (ε, δ) guarantee also holds at any larger δ, so a bound at the largest
  speaks against every model's claim."""
  return max(plan_lib.resolve_delta(delta, int(n))
             for n in np.sum(member, axis=1))


def epsilon_bounds(lira: np.ndarray, member: np.ndarray, *, delta: float,
                   confidence: float = CONFIDENCE) -> dict:
  """jax-privacy's one-run ε estimators over all (model, user) pairs, Λ
  (`lira`, [M, U]) the score and `member` the coin: `epsilon_lower_bound`
  (f-DP, Mahloujifar et al.) and `epsilon_one_run` (Steinke et al.), with
  the `bound_delta` and `confidence` they are stated at. A statistic
  comparable across settings and with the retrieval canaries' one-run
  bound, not a certified bound (the module docstring says why)."""
  bounds = audit_scores.lower_bound(np.ravel(lira), np.ravel(member),
                                    delta=delta, confidence=confidence)
  return dict(bounds, bound_delta=delta, confidence=confidence)


# ---------------------------------------------------------------------------
# The experiment: train, score, attack, tabulate.
# ---------------------------------------------------------------------------


def setting_fields(setting: str, epsilon: float,
                   example_batch_size: int) -> dict:
  """The RunConfig fields of one privacy setting over the shared
  (user-level) gin:
  'user' keeps it; 'example' and 'nonprivate' Poisson-sample chunks,
  `example_batch_size` a step (the user-level step's expected examples), the
  latter with plain AdamW steps (no clipping, no noise)."""
  if setting == "user":
    return dict(target_epsilon=epsilon)
  example = dict(privacy_unit="example", batch_size=example_batch_size)
  if setting == "example":
    return dict(example, target_epsilon=epsilon)
  if setting == "nonprivate":
    return dict(example, target_epsilon="inf", public_task_name="multidogo_lm",
                redaction_schedule="constant", redaction_probability=1.0)
  raise ValueError(f"unknown setting {setting!r}; settings are {SETTINGS}")


def run(out_dir: str, *, settings: Sequence[str] = SETTINGS,
        epsilon: float = 8.0, num_models: int = 8,
        gin_files: Sequence[str] = ("dialog_sample_user_level.gin",),
        bindings: Sequence[str] = (), seed: int = 0,
        batch_size: int = 64) -> dict:
  """Trains `num_models` models per setting on random halves of the users,
  attacks them, writes `results.jsonl`, `table.md` and `table.csv` under
  `out_dir`; returns {"rows", "table_md"}. Resumable: finished runs and
  scored settings are skipped; a rerun with another ε, model count, seed or
  gin is a `CheckpointMismatchError` naming what differs.

  `gin_files`/`bindings` configure a user-level run on MultiDoGo
  (`privacy_unit = 'user'`, unpacked chunks); `seed` draws the splits (the
  public design of the experiment, not a DP secret)."""
  from dpjax.data import arrays as data_arrays  # lazy: TensorFlow

  unknown = set(settings) - set(SETTINGS)
  if unknown or not settings:
    raise errors.UsageError(f"settings are a non-empty subset of "
                             f"{SETTINGS}, got {list(settings)}")
  _check_model_count(num_models)
  root = os.path.abspath(out_dir)
  # A rerun may add settings; any other change would mix its runs and
  # splits with these.
  harness.check_settings(root, dict(
      epsilon=epsilon, num_models=num_models, seed=seed,
      gin_files=list(gin_files), bindings=list(bindings)))
  base = harness.configured(configurables.run_config, gin_files, bindings)
  if base.privacy_unit != "user":
    raise errors.UsageError("the shared gin must configure a user-level "
                             "run (train.privacy_unit = 'user')")
  tasks.register_tasks()
  lengths, task = base.task_feature_lengths, base.mixture_or_task_name
  train = data_arrays.load_task_arrays(task, "train", lengths,
                                       converter="decoder_only")
  users = data_arrays.load_task_column(task, "train", lengths, base.user_column)
  users = np.array([u.decode() if isinstance(u, bytes) else str(u)
                    for u in users])
  validation = data_arrays.load_task_arrays(task, "validation", lengths,
                                            converter="decoder_only")
  user_ids = sorted(set(users))
  member = membership_splits(len(user_ids), num_models,
                             np.random.default_rng(seed))
  delta = bound_delta(base.delta, member)
  per_user = np.bincount(np.searchsorted(user_ids, users))
  example_batch = round(base.batch_size * float(
      np.minimum(per_user, base.max_examples_per_user).mean()))

  for folder in ("splits", "scores"):
    os.makedirs(os.path.join(root, folder), exist_ok=True)
  split_paths = []
  for m in range(num_models):
    path = os.path.join(root, "splits", f"model{m}.txt")
    if not os.path.isfile(path):
      fileio.write_atomic(path, "".join(
          f"{u}\n" for u, keep in zip(user_ids, member[m]) if keep))
    split_paths.append(path)

  rows = []
  for setting in settings:
    cached = os.path.join(root, "scores", f"{setting}.json")
    if not os.path.isfile(cached):
      scores, perplexities, epsilons = [], [], []
      for m, split in enumerate(split_paths):
        run_dir = os.path.join(root, "runs", setting, f"model{m}")
        harness.train_run(run_dir, gin_files, [
            *bindings,
            f"register_multidogo_tasks.train_conversations_path = {split!r}"],
                          **setting_fields(setting, epsilon, example_batch))
        config, params, meta = inference.load_trained(run_dir)
        sums, counts = gpt2.nll_sums(config, params, train["tokens"],
                                     train["loss_weights"],
                                     batch_size=batch_size)
        scores.append(user_scores(sums, counts, users, user_ids))
        perplexities.append(gpt2.perplexity(
            config, params, validation["tokens"], validation["loss_weights"],
            batch_size=batch_size))
        # The ledger of the checkpoint just verified and scored: reading
        # it again (`verify.run_ledger`) would verify the run twice.
        epsilons.append(math.inf if setting == "nonprivate" else
                        meta.privacy_ledger().epsilon_spent())
      fileio.write_atomic(cached, json.dumps(dict(
          scores=np.asarray(scores).tolist(), perplexity=perplexities,
          epsilon_spent=epsilons)))
    with open(cached) as f:
      record = json.load(f)
    lira = lira_scores(np.array(record["scores"]), member)
    attack = dict(attack_metrics(lira, member),
                  **epsilon_bounds(lira, member, delta=delta))
    rows.append(dict(setting=setting, epsilon=epsilon if setting != "nonprivate"
                     else math.inf,
                     epsilon_spent=max(record["epsilon_spent"]),
                     validation_ppl=float(np.mean(record["perplexity"])),
                     models=num_models, users=len(user_ids),
                     example_batch_size=example_batch, **attack))
  return write_outputs(root, rows)


def write_outputs(root: str, rows: Sequence[Mapping]) -> dict:
  """Writes the membership results and table under `root`; prints the table.

  Returns:
    `{"rows": rows, "table_md": the path of table.md}`.
  """
  harness.write_results(os.path.join(root, harness.RESULTS_FILENAME),
                        [dict(r, kind="membership") for r in rows])
  header = ["training", "ε spent", "validation PPL", "LiRA AUC",
            *(f"TPR @ {f:.0%} FPR" for f in FPRS),
            "ε lower bound (one run)", "models", "users"]
  table = [[LABELS[r["setting"]],
            ("∞" if math.isinf(r["epsilon_spent"])
             else f"{r['epsilon_spent']:.3f}"),
            f"{r['validation_ppl']:.2f}", f"{r['auc']:.3f}",
            *(f"{r[f'tpr@{f:g}']:.3f}" for f in FPRS),
            f"{r['epsilon_lower_bound']:.3f}", str(r["models"]),
            str(r["users"])] for r in rows]
  # One δ and confidence for all rows of an experiment (`bound_delta`).
  delta, confidence = rows[0]["bound_delta"], rows[0]["confidence"]
  md = os.path.join(root, "table.md")
  text = harness.write_table(
      table, header, md, os.path.join(root, "table.csv"),
      title="User-level membership inference (LiRA) on MultiDoGo",
      notes=["Each user (conversation) trains half of the models; every "
             "model is attacked with the others as shadows. AUC 0.5 and "
             "TPR = FPR: the attack cannot tell members. Validation PPL: "
             "mean over the models.",
             "ε lower bound (one run): jax-privacy's f-DP one-run estimator "
             "(Mahloujifar et al.) on the LiRA statistic over all (model, "
             f"user) pairs, at {confidence:.0%} confidence and δ = "
             f"{delta:.3g} (the user-level ledgers', for every row); the "
             "same estimator as the retrieval canaries' one-run bound. A "
             "comparable statistic, not a certified bound: the pairs come "
             "from several models with tied coins, not from one run "
             "(dpjax/pipelines/dialog/membership.py)."])
  print(text, end="", flush=True)
  return {"rows": list(rows), "table_md": md}
