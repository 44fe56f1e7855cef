"""The domain-privacy experiment (Kabra & Elenberg, Findings of EMNLP 2023,
arXiv 2305.14208, Sec. 5.2, 6; Figures 1-2): every target model's test
perplexity, LiRa success rate per policy and ε.

Target models (Sec. 5.2), all GPT-2 on the pooled domains D unless said:

* `{d_i} Only` (baseline): trained on d_i alone, non-private.
* Public: non-private (AdamW) on the original D.
* Pub+Redacted: non-private on D redacted by a policy (keyword or
  classifier).
* Private: DP-AdamW on the original D at ε.
* JFT: DP-AdamW on the original D at ε, initialised from that policy's
  Pub+Redacted model (so twice the training of the others, as the paper's
  "2x").
* Redaction Schedule: one run mixing non-private steps on the redacted D
  and DP steps on the original D by the exp-concave schedule (η from the gin
  file, 15); σ is calibrated for its DP steps only.

Non-private runs are trainer runs whose every step is a public step (the
'constant' redaction schedule with p = 1): plain AdamW on mean gradients, no
clipping or noise, and no ledger entry. ε in the table is the ledger's ε
spent for runs that touch the original data only through DP steps (Private,
JFT, Redaction Schedule; Pub+Redacted has none: ε = 0, the paper's "ideal
guarantee", which assumes the redacted data is public), and ∞ for runs
trained non-privately on original text (d_i Only, Public).

The attack (`dpjax.pipelines.dialog.lira`) prompts each target with contexts of d_i's
test conversations. Its reference models are M_{D̄_j}, trained
non-privately on D without d_j (`multidogo_lm_without_{j}`), one per other
domain j; a generation succeeds under a policy when the policy flags it for
some j ≠ i. Every target is attacked under every policy, so the table has
one row per (target, policy), like the paper's Figure 1. Test perplexity is
per token on the test split of d_i (the paper's axis: its evaluation script
scores the prompt domain) and of all of D.

Resumable: finished runs (`train_summary.json` complete), the domain
classifier and each target's attack are skipped when rerun. Writes, under
`out_dir`: `runs/<name>/` (trainer run directories), `domain_classifier/`,
`attacks/<name>/{generations.jsonl,summary.json}`, `results.jsonl`,
`table.md`, `table.csv` and `success_vs_ppl.png`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import gin

import tasks
from dpjax import configurables, errors, fileio, verify
from dpjax.pipelines import harness
from dpjax.generation import inference
from dpjax.training import run_config as run_config_lib
from dpjax.data.readers import multidogo
from dpjax.pipelines.dialog import classifier, lira
from dpjax.models import gpt2
from dpjax.data.text import redaction
from tasks import multidogo as multidogo_tasks

MODES = ("domain_only", "public", "pub_redacted", "private", "jft",
         "redaction_schedule")
POLICIES = ("keyword", "classifier")
POLICY_LABELS = {"keyword": "Keyword", "classifier": "Classifier"}


def _nonprivate(task: str) -> dict:
  """Every step a public (plain AdamW) step on `task` (RunConfig fields)."""
  return dict(mixture_or_task_name=task, target_epsilon="inf",
              public_task_name=task, redaction_schedule="constant",
              redaction_probability=1.0)


def _private(task: str, epsilon: float) -> dict:
  return dict(mixture_or_task_name=task, target_epsilon=epsilon)


def target_runs(prompt_domain: str, modes: Sequence[str],
                policies: Sequence[str], epsilon: float) -> list[dict]:
  """The target models in table order: {name, label, policy (trained
  with), fields (its RunConfig's), private_only (ε from the ledger, else ∞), after (the run
  it starts from), stage_only (trained for JFT, not attacked)}."""
  unknown = set(modes) - set(MODES) or set(policies) - set(POLICIES)
  if unknown:
    raise ValueError(f"unknown modes/policies {sorted(unknown)}; modes are "
                     f"{MODES}, policies {POLICIES}")
  runs = []
  add = lambda name, label, fields, private_only, policy=None, after=None: \
      runs.append(dict(name=name, label=label, policy=policy, fields=fields,
                       private_only=private_only, after=after,
                       stage_only=False))
  lower = prompt_domain.lower()
  if "domain_only" in modes:
    add(f"{lower}_only", f"{prompt_domain} Only",
        _nonprivate(f"multidogo_lm_only_{lower}"), False)
  if "public" in modes:
    add("public", "Public", _nonprivate("multidogo_lm"), False)
  if "private" in modes:
    add("private", "Private", _private("multidogo_lm", epsilon), True)
  for p in policies:
    label, redacted = POLICY_LABELS[p], f"multidogo_lm_redacted_{p}"
    if "pub_redacted" in modes or "jft" in modes:
      add(f"pub_redacted_{p}", f"Pub+Redacted ({label})", _nonprivate(redacted),
          True, p)
      # Trained as JFT's first stage only: not attacked.
      runs[-1]["stage_only"] = "pub_redacted" not in modes
    if "jft" in modes:
      add(f"jft_{p}", f"JFT ({label})", _private("multidogo_lm", epsilon), True, p,
          after=f"pub_redacted_{p}")
    if "redaction_schedule" in modes:
      add(f"redaction_schedule_{p}", f"Redaction Schedule ({label})",
          dict(_private("multidogo_lm", epsilon), public_task_name=redacted,
               redaction_schedule="exp_concave"), True, p)
  return runs


class _Settings:
  """The gin files + bindings every run shares, and the typed records they
  configure (the MultiDoGo tasks', one run's)."""

  def __init__(self, gin_files: Sequence[str], bindings: Sequence[str]):
    self.gin_files, self.bindings = list(gin_files), list(bindings)

  def multidogo(self) -> multidogo_tasks.MultidogoConfig:
    return harness.configured(multidogo_tasks.MultidogoConfig,
                              self.gin_files, self.bindings)

  def run_config(self) -> run_config_lib.RunConfig:
    return harness.configured(configurables.run_config, self.gin_files,
                              self.bindings)


def _train_classifier(path: str, data: multidogo_tasks.MultidogoConfig,
                      epochs: float) -> None:
  """The classifier policy's model, trained once on the training split."""
  if os.path.isfile(os.path.join(path, "config.json")):
    return
  argv = [f"--output_dir={path}", f"--domains={','.join(data.domains)}",
          f"--epochs={epochs}", f"--split_seed={data.split_seed}"]
  for flag, value in (("data_dir", data.data_dir),
                      ("vocab_path", data.bpe_vocab_path),
                      ("merges_path", data.bpe_merges_path)):
    if value:
      argv.append(f"--{flag}={value}")
  gin.clear_config()
  classifier.main(argv)


def _load_model(run_dir: str) -> tuple[lira.Model, dict]:
  config, params, meta = inference.load_trained(run_dir)
  return lira.Model(config, params), meta


def domain_privacy_table(out_dir: str, *, prompt_domain: str = "AIRLINE",
                         modes: Sequence[str] = MODES,
                         policies: Sequence[str] = POLICIES,
                         epsilon: float = 8.0,
                         gin_files: Sequence[str] = ("dialog_sample.gin",),
                         bindings: Sequence[str] = (),
                         num_conversations: int = 10,
                         prompts_per_conversation: int = 10,
                         num_samples: int = lira.PAPER_NUM_SAMPLES,
                         max_new_tokens: int = 64, top_k: int = lira.PAPER_TOP_K,
                         top_fraction: float = 0.1, classifier_epochs: float = 3.0,
                         seed: int = 0, batch_size: int = 64) -> dict:
  """Trains the targets and references, attacks each target, writes the
  table (see the module docstring); returns {"rows", "table_md", "plot"}.

  Args:
    out_dir: everything goes here.
    prompt_domain: d_i, the domain of the prompts (the paper's AIRLINE).
    modes, policies: subsets of MODES and POLICIES (policies both redact the
      training data of their modes and flag generations).
    epsilon: ε of the DP runs (the paper's 8).
    gin_files, bindings: the GPT-2 settings every run shares
      (`gin/dialog_sample.gin` on the embedded sample, `gin/dialog_gpt2.gin`
      for the paper's); the MultiDoGo data and chunking come from their
      `register_multidogo_tasks` bindings, the classifier policy's threshold
      from `classifier_policy.threshold`.
    num_conversations, prompts_per_conversation: the prompts (paper: 10 x
      10 = 100 test contexts of d_i).
    num_samples, max_new_tokens, top_k: generations per prompt (paper: 10,
      top-k 40).
    top_fraction: the top-ranked success rate's share of non-empty
      generations.
    classifier_epochs: training epochs of the classifier policy's model.
    seed, batch_size: sampling seed; batch of generation and scoring.
  """
  from dpjax.data import arrays as data_arrays  # lazy: TensorFlow
  root = os.path.abspath(out_dir)
  settings = _Settings(gin_files, bindings)
  data = settings.multidogo()
  domains = tuple(data.domains or multidogo.PAPER_DOMAINS)
  if prompt_domain not in domains or len(domains) < 2:
    raise errors.UsageError(f"prompt_domain {prompt_domain!r} must be one of "
                             f"at least two domains {list(domains)}")
  others = [d for d in domains if d != prompt_domain]
  targets = target_runs(prompt_domain, modes, policies, epsilon)

  extra = []  # bindings every run shares from here on
  if "classifier" in policies:
    clf_dir = os.path.join(root, "domain_classifier")
    _train_classifier(clf_dir, dataclasses.replace(data, domains=domains),
                      classifier_epochs)
    extra += ["register_multidogo_tasks.classifier_policy = @classifier_policy",
              f"classifier_policy.classifier_dir = '{clf_dir}'"]
  settings = _Settings(gin_files, [*bindings, *extra])

  run_dir = lambda name: os.path.join(root, "runs", name)
  references = {j: f"reference_without_{j.lower()}" for j in others}
  for j, name in references.items():
    harness.train_run(run_dir(name), settings.gin_files, settings.bindings,
                      **_nonprivate(f"multidogo_lm_without_{j.lower()}"))
  summaries = {}
  for t in targets:
    init = ({"initial_checkpoint_path": run_dir(t["after"])} if t["after"]
            else {})
    summaries[t["name"]] = harness.train_run(
        run_dir(t["name"]), settings.gin_files, settings.bindings,
        **t["fields"], **init)

  # Attack and evaluation settings: the shared gin config (left bound by
  # `run_config`), tasks registered.
  lengths = settings.run_config().task_feature_lengths
  tasks.register_tasks()
  vocabulary = _task_vocabulary("multidogo_lm")
  conversations = [c for c in multidogo.load_split(
      "test", data.data_dir, domains, seed=data.split_seed)
                   if c.domain == prompt_domain]
  prompts = lira.conversation_prompts(
      conversations, num_conversations=num_conversations,
      prompts_per_conversation=prompts_per_conversation,
      domain_tokens=data.domain_tokens)
  policy_objects = _policies(policies, data)
  test_sets = {key: data_arrays.load_task_arrays(task, "test", lengths,
                                                 converter="decoder_only")
               for key, task in ((prompt_domain, f"multidogo_lm_only_"
                                  f"{prompt_domain.lower()}"),
                                 ("all", "multidogo_lm"))}
  reference_models = {j: _load_model(run_dir(name))[0]
                      for j, name in references.items()}
  attack_settings = dict(num_samples=num_samples, max_new_tokens=max_new_tokens,
                         top_k=top_k, top_fraction=top_fraction, seed=seed)

  rows = []
  for t in targets:
    if t["stage_only"]:
      continue
    path = os.path.join(root, "attacks", t["name"], "summary.json")
    if os.path.isfile(path):
      with open(path) as f:
        evaluation = json.load(f)
    else:
      model, _ = _load_model(run_dir(t["name"]))
      records, attack_summary = lira.attack(
          model, reference_models, prompts, vocabulary=vocabulary,
          policies=policy_objects, batch_size=batch_size, **attack_settings)
      evaluation = {
          "test_ppl": {k: gpt2.perplexity(
              model.config, model.params, a["tokens"], a["loss_weights"],
              batch_size=batch_size) for k, a in test_sets.items()},
          "attack": attack_summary, "num_prompts": len(prompts),
          "settings": attack_settings}
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fileio.write_atomic(os.path.join(os.path.dirname(path), "generations.jsonl"),
                          "".join(json.dumps(r) + "\n" for r in records))
      fileio.write_atomic(path, json.dumps(evaluation, indent=2))
    rows += _rows(t, summaries[t["name"]], run_dir(t["name"]), evaluation,
                  prompt_domain, others)
  return _write_outputs(root, rows, prompt_domain, others, top_fraction)


def _task_vocabulary(task: str):
  import seqio  # lazy: TensorFlow
  return seqio.get_mixture_or_task(task).output_features["targets"].vocabulary


def _policies(names: Sequence[str], data: multidogo_tasks.MultidogoConfig
              ) -> dict[str, redaction.Policy]:
  """The attack's policies, as the redacted tasks are configured."""
  out = {}
  if "keyword" in names:
    out["keyword"] = redaction.KeywordPolicy.from_json(
        data.keywords_path or multidogo.DEFAULT_KEYWORDS_PATH)
  if "classifier" in names:
    out["classifier"] = classifier.classifier_policy()  # as gin binds it
  return out


def _epsilon(target: dict, model_dir: str) -> float:
  if not target["private_only"]:
    return math.inf
  return verify.run_ledger(model_dir).epsilon_spent()


def _rows(target: dict, summary: dict, model_dir: str, evaluation: dict,
          prompt_domain: str, others: Sequence[str]) -> list[dict]:
  """One row per attack policy."""
  out = []
  for policy, by in evaluation["attack"].items():
    row = {"mode": target["label"], "run": target["name"],
           "trained_with": target["policy"], "attack_policy": policy,
           f"test_ppl_{prompt_domain}": evaluation["test_ppl"][prompt_domain],
           "test_ppl_all": evaluation["test_ppl"]["all"],
           "epsilon": _epsilon(target, model_dir),
           "dp_steps": summary.get("dp_steps"),
           "public_steps": summary.get("public_steps"), **by["all"]}
    row.update({f"success_rate_{j}": by[j]["success_rate"] for j in others})
    out.append(row)
  return out


def _fmt(x, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if isinstance(x, float) and math.isinf(x):
    return "∞"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _write_outputs(root: str, rows: list[dict], prompt_domain: str,
                   others: Sequence[str], top_fraction: float) -> dict:
  harness.write_results(os.path.join(root, harness.RESULTS_FILENAME), rows)
  top = f"top {top_fraction:.0%} success rate"
  header = ["mode", "attack policy", f"test PPL ({prompt_domain})",
            "test PPL (all)", "success rate", top,
            *[f"success rate ({j})" for j in others], "non-empty / generations",
            "ε", "DP / public steps"]
  table = [[r["mode"], POLICY_LABELS[r["attack_policy"]],
            _fmt(r[f"test_ppl_{prompt_domain}"], 2), _fmt(r["test_ppl_all"], 2),
            _fmt(r["success_rate"]), _fmt(r["top_success_rate"]),
            *[_fmt(r[f"success_rate_{j}"]) for j in others],
            f"{r['non_empty']} / {r['generations']}", _fmt(r["epsilon"], 2),
            f"{r['dp_steps']} / {r['public_steps']}"] for r in rows]
  md = os.path.join(root, "table.md")
  text = harness.write_table(
      table, header, md, os.path.join(root, "table.csv"),
      title=f"Domain privacy: {prompt_domain} prompts (paper 004, Figure 1)",
      notes=["Success rate: generations flagged by the attack policy for "
             f"another domain ({', '.join(others)}) / non-empty generations "
             "(lower is better); the top rate counts the generations ranked "
             "highest by LiRa score PPL_ref / PPL_target (references trained "
             f"without each of {', '.join(others)}). Test PPL: per token "
             "(lower is better). ε: ledger ε spent at δ = 1/(2n); ∞ for "
             "non-private training on original text."])
  plot = os.path.join(root, "success_vs_ppl.png")
  _plot(rows, prompt_domain, plot)
  print(text, end="", flush=True)
  return {"rows": rows, "table_md": md, "plot": plot}


def _plot(rows: list[dict], prompt_domain: str, path: str) -> None:
  """Success rate vs test perplexity, one point per (mode, attack policy):
  the paper's figure; one ε here, so no plot against ε."""
  fig, ax = harness.pyplot().subplots(figsize=(7, 5))
  for policy, marker in zip(POLICIES, ("o", "s")):
    points = [r for r in rows if r["attack_policy"] == policy]
    if not points:
      continue
    x = [r[f"test_ppl_{prompt_domain}"] for r in points]
    y = [r["success_rate"] for r in points]
    ax.scatter(x, y, marker=marker, label=f"{POLICY_LABELS[policy]} policy")
    for r, xi, yi in zip(points, x, y):
      ax.annotate(r["mode"], (xi, yi), fontsize=7, xytext=(3, 3),
                  textcoords="offset points")
  ax.set_xlabel(f"test perplexity ({prompt_domain})")
  ax.set_ylabel("LiRa success rate")
  ax.set_title(f"Domain leakage from {prompt_domain} prompts (lower is better)")
  ax.legend()
  fig.tight_layout()
  harness.save_figure(fig, path)


__all__ = ["MODES", "POLICIES", "target_runs", "domain_privacy_table"]
