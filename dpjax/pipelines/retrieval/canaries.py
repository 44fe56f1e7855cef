"""Canary exposure audit of a document -> query generator (Carranza et al.,
NAACL 2024, arXiv 2305.05973, Sec. 6.3, Table 7; exposure from Carlini et al.
2019, "The Secret Sharer").

Canaries. The paper lists three kinds of (query, document) pair, "the secret
part of each canary is the random 10-digit string": (random query, random
10-digit string), (random query, corresponding document + random 10-digit
string), (random query, random document + random 10-digit string). Read
literally the secret sits in the document, the generator's INPUT: a
document -> query model never emits its input, so neither a rank of the
secret under the model nor the leak rates of Table 7 (67% / 100% at ε = ∞)
could be measured, and documents are public in the paper's threat model
(query-level privacy; the synthetic set republishes every document). So the
secret goes where the generator can memorise it and DP protects it: at the
end of the canary's QUERY, `"<random query> <secret>"` (Carlini et al.'s
prefix + secret format), and the three kinds keep the paper's three
documents:

* `digits_document`: a new passage that is a random 10-digit string (no
  content; the model can only memorise the pair);
* `own_document`: the random query's own (relevant) training passage;
* `other_document`: an unrelated random training passage.

The random query is a real training query drawn at random (the kind
`own_document` needs its passage). Each canary is inserted `r` times (r in
1, 10, 100) as r qrels rows with new qids and the same passage, into a copy
of the MSMARCO directory (`insert_canaries`). At audit time the generator is
prompted as in the pipeline, `"generate_query: " + document`.

Measures, per canary (`audit`):

* rank and exposure: the canary query's log-likelihood log p(prefix +
  secret | document) (the negative log-perplexity of Carlini et al.; only
  the secret differs between candidates) against `num_candidates` secrets
  drawn uniformly from the 10^10 ten-digit strings. `better` = candidates
  scoring strictly higher; rank among the sample = better + 1; the rank in
  the full space is estimated as 1 + (10^10 - 1) * better / R and
  exposure = log2(10^10) - log2(rank). With better = 0 that gives the
  maximum 33.2 bits, though R samples only resolve about log2(R) bits; the
  extrapolated exposure of Carlini et al. (Sec. 4.3 there: a skew-normal
  fitted to the candidates' log-perplexities, exposure = -log2 CDF(true))
  is reported beside it (`exposure_skewnorm`).
* extraction: the secret appears verbatim in a generation from the canary's
  document, with the pipeline's decoding (nucleus p = 0.8, one sample per
  document, as the synthetic set has) and greedily.
* an empirical ε lower bound from the rank attack (`epsilon_lower_bound`).
* beside it, jax-privacy's one-run ε estimators on the canaries' true
  secrets (IN) against one candidate secret each (OUT; its score
  `candidate_score`), the same estimators the dialog membership study
  reports (`one_run_bounds`: `epsilon_lower_bound_one_run`,
  `epsilon_one_run`); the ε of a group of 2r examples, and a comparable
  statistic rather than a certified bound (see there).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize, stats

from dpjax.generation import decoding, inference
from dpjax import fileio
from dpjax.audit import scores as audit_scores
from dpjax.data.readers import msmarco
from dpjax.eval import encoding
from dpjax.models import t5
from tasks import msmarco as msmarco_tasks

KINDS = ("digits_document", "own_document", "other_document")
REPETITIONS = (1, 10, 100)
SECRET_DIGITS = 10
SECRET_SPACE = 10 ** SECRET_DIGITS
CANARIES_FILE = "canaries.json"
_SPLIT_FILES = ("queries.{}.tsv", "qrels.{}.tsv")


@dataclasses.dataclass(frozen=True)
class Canary:
  """One canary: `prefix + " " + secret` is its query, inserted once per qid."""
  kind: str
  repetitions: int
  pid: int
  document: str
  prefix: str
  secret: str
  qids: tuple[int, ...]

  @property
  def query(self) -> str:
    """The canary's query: `prefix + " " + secret`."""
    return f"{self.prefix} {self.secret}"


def _secret(rng: np.random.Generator) -> str:
  return f"{int(rng.integers(SECRET_SPACE)):0{SECRET_DIGITS}d}"


def make_canaries(pairs: Sequence[tuple[int, int, str, str]], *,
                  first_pid: int, first_qid: int, per_cell: int = 2,
                  kinds: Sequence[str] = KINDS,
                  repetitions: Sequence[int] = REPETITIONS, seed: int = 0
                  ) -> list[Canary]:
  """`per_cell` canaries per (kind, repetitions), a function of the arguments.

  `pairs`: the training `(qid, pid, query, passage)` rows
  (`msmarco.load_query_passage_pairs`). Every canary gets its own random
  query and its own passage (no two canaries share a pid); new passages get
  pids from `first_pid` and new queries qids from `first_qid`, so nothing
  collides with the data.
  """
  unknown = set(kinds) - set(KINDS)
  if unknown or per_cell < 1 or min(repetitions, default=0) < 1:
    raise ValueError(f"kinds must be in {KINDS}, per_cell and repetitions "
                     f"positive; got {kinds}, {per_cell}, {repetitions}")
  cells = [(k, r) for k in kinds for r in repetitions for _ in range(per_cell)]
  passages, first = {}, {}
  for i, (_, pid, _, passage) in enumerate(pairs):
    passages[pid] = passage
    first.setdefault(pid, i)
  first_rows = list(first.values())
  others = sum(k == "other_document" for k, _ in cells)
  if len(first_rows) < len(cells) + others:
    raise ValueError(f"{len(cells)} canaries need {len(cells) + others} "
                     f"distinct passages; the data has {len(first_rows)}")
  rng = np.random.default_rng(seed)
  # One row per passage, so the queries' passages are distinct; the extra
  # rows give the unrelated passages of the other_document canaries.
  rows = rng.choice(first_rows, len(cells) + others, replace=False)
  unrelated = iter(int(pairs[i][1]) for i in rows[len(cells):])
  secrets: set[str] = set()
  canaries, qid, pid = [], first_qid, first_pid
  for (kind, reps), row in zip(cells, rows):
    _, own_pid, query, _ = pairs[row]
    secret = _secret(rng)
    while secret in secrets:
      secret = _secret(rng)
    secrets.add(secret)
    if kind == "digits_document":
      doc_pid, document, pid = pid, _secret(rng), pid + 1
    else:
      doc_pid = own_pid if kind == "own_document" else next(unrelated)
      document = passages[doc_pid]
    canaries.append(Canary(kind, reps, doc_pid, document, query, secret,
                           tuple(range(qid, qid + reps))))
    qid += reps
  return canaries


def _max_id(path: str) -> int:
  return max((i for i, _ in msmarco.read_tsv_pairs(path)), default=-1)


def _copy_with(source: str, target: str, extra_lines: Sequence[str]) -> None:
  """`source` streamed to `target` (atomically), then `extra_lines`."""
  with fileio.open_atomic(target, "wb") as out, open(source, "rb") as f:
    shutil.copyfileobj(f, out)
    f.seek(0, os.SEEK_END)
    if f.tell():
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        out.write(b"\n")
    out.write("".join(extra_lines).encode("utf-8"))


def insert_canaries(data_dir: str, out_dir: str, *, per_cell: int = 2,
                    kinds: Sequence[str] = KINDS,
                    repetitions: Sequence[int] = REPETITIONS, seed: int = 0
                    ) -> list[Canary]:
  """Writes `data_dir` + canaries as a new MSMARCO directory `out_dir`.

  `collection.tsv` gains the new (digits) passages, `queries.train.tsv` one
  line per canary qid, `qrels.train.tsv` one `qid 0 pid 1` row per qid; the
  dev files are copied unchanged. `canaries.json` (the secrets: the audit's
  ground truth, never training data) is written last, so an existing one
  marks a finished directory and is read back instead.
  """
  record = os.path.join(out_dir, CANARIES_FILE)
  if os.path.isfile(record):
    return load_canaries(out_dir)
  pairs = msmarco.load_query_passage_pairs(data_dir, "train")
  first_qid = 1 + max(_max_id(os.path.join(data_dir, f"queries.{s}.tsv"))
                      for s in ("train", "dev"))
  first_pid = 1 + _max_id(os.path.join(data_dir, msmarco.COLLECTION_FILE))
  canaries = make_canaries(pairs, first_pid=first_pid, first_qid=first_qid,
                           per_cell=per_cell, kinds=kinds,
                           repetitions=repetitions, seed=seed)
  os.makedirs(out_dir, exist_ok=True)
  new_docs = [f"{c.pid}\t{c.document}\n" for c in canaries
              if c.kind == "digits_document"]
  _copy_with(os.path.join(data_dir, msmarco.COLLECTION_FILE),
             os.path.join(out_dir, msmarco.COLLECTION_FILE), new_docs)
  extra = {"train": ([f"{q}\t{c.query}\n" for c in canaries for q in c.qids],
                     [f"{q}\t0\t{c.pid}\t1\n" for c in canaries for q in c.qids]),
           "dev": ([], [])}
  for split, lines in extra.items():
    for name, add in zip(_SPLIT_FILES, lines):
      _copy_with(os.path.join(data_dir, name.format(split)),
                 os.path.join(out_dir, name.format(split)), add)
  fileio.write_atomic(record, json.dumps(
      {"source": os.path.abspath(data_dir), "seed": seed,
       "canaries": [dataclasses.asdict(c) for c in canaries]}, indent=1))
  return canaries


def load_canaries(data_dir: str) -> list[Canary]:
  """The canaries recorded in `data_dir`'s `CANARIES_FILE`."""
  with open(os.path.join(data_dir, CANARIES_FILE), encoding="utf-8") as f:
    rows = json.load(f)["canaries"]
  return [Canary(**dict(r, qids=tuple(r["qids"]))) for r in rows]


# ---------------------------------------------------------------------------
# Exposure, extraction and the ε lower bound.
# ---------------------------------------------------------------------------


def make_sequence_scorer(config: t5.T5Config):
  """`score(params, inputs [Li], targets [b, Lt]) -> [b]`: log p(target row |
  inputs) summed over the row's non-pad tokens (EOS included), one encoder
  pass shared by the b candidate targets; jitted (one compilation per shape).
  """
  model = t5.T5Transformer(config)

  @jax.jit
  def score(params, inputs, targets):
    variables = {"params": params}
    encoded = model.apply(variables, inputs[None], method=model.encode)
    b = targets.shape[0]
    logits = model.apply(
        variables, jnp.broadcast_to(encoded, (b, *encoded.shape[1:])),
        jnp.broadcast_to(inputs[None], (b, inputs.shape[0])),
        jnp.pad(targets[:, :-1], ((0, 0), (1, 0))), method=model.decode)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    token = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.where(targets != encoding.PAD_ID, token, 0.0).sum(-1)

  return score


def exposure(true_score: float, candidate_scores: np.ndarray,
             space_size: int = SECRET_SPACE) -> dict:
  """Rank and exposure of a secret from R sampled candidates' scores
  (log-likelihoods; higher = more likely), estimated as in the module
  docstring; `exposure_skewnorm` is Carlini et al.'s extrapolation."""
  candidates = np.asarray(candidate_scores, np.float64)
  better = int(np.sum(candidates > true_score))
  rank = 1 + (space_size - 1) * better / len(candidates)
  # Log-perplexity = -score: the fitted CDF at the secret's log-perplexity
  # is the fraction of the space expected to be at least as likely.
  fit = stats.skewnorm.fit(-candidates)
  log2_cdf = stats.skewnorm.logcdf(-true_score, *fit) / math.log(2)
  return {"better": better, "sample_rank": better + 1,
          "rank": rank, "exposure": math.log2(space_size) - math.log2(rank),
          "exposure_skewnorm": float(min(math.log2(space_size), -log2_cdf))}


def extracted(secret: str, generations: Sequence[str]) -> bool:
  """Whether `secret` appears verbatim in any generation."""
  return any(secret in g for g in generations)


def clopper_pearson_lower(successes: int, trials: int,
                          confidence: float = 0.95) -> float:
  """One-sided Clopper–Pearson lower bound of a success probability."""
  if not 0 <= successes <= trials or trials < 1:
    raise ValueError(f"need 0 <= successes <= trials, trials > 0; got "
                     f"{successes}, {trials}")
  if successes == 0:
    return 0.0
  return float(stats.beta.ppf(1 - confidence, successes,
                              trials - successes + 1))


def epsilon_lower_bound(successes: int, trials: int, *, null_success: float,
                        delta: float, group_size: int = 1,
                        confidence: float = 0.95) -> float:
  """The smallest per-example ε consistent with a secret-guessing attack.

  The attack (fixed before the audit): draw R candidate secrets uniformly,
  independently of the canary, and claim the canary's secret is a string
  beaten by at most m of them; it succeeds when the true secret is, i.e.
  `better <= m`. `null_success` = (m + 1) / (R + 1).

  Formal guarantees. Let the secret s be uniform over the N strings and the
  mechanism M (training) be (ε, δ)-DP for one example under the neighbouring
  relation of its accountant (add/remove one example for Poisson sampling).
  Datasets with different secrets differ in `group_size` such steps (a
  canary repeated r times: r removals and r additions, 2r), so by group
  privacy M is (gε, g e^{(g-1)ε} δ)-DP between them. Fix any reference
  secret s0. The claimed set S (all strings beaten by at most m of the
  candidates) holds each uniformly drawn string with probability
  (m + 1) / (R + 1) at most (its rank among R + 1 exchangeable draws), so
  avg_s P[s ∈ S | M(D_s0)] <= null_success, and by DP
    P[success] = avg_s P[s ∈ S | M(D_s)] <= e^{gε} null_success
                                             + g e^{(g-1)ε} δ.
  With P[success] >= p_lo, the one-sided Clopper–Pearson lower bound at
  `confidence` from `successes` of `trials`, the returned ε is the smallest
  satisfying that inequality (0 when ε = 0 does). Assumption beyond the
  theorem: the canaries of one trained model count as independent trials
  (as in Carlini et al. and Stock et al.); strictly, each would need its own
  training run.
  """
  p_lo = clopper_pearson_lower(successes, trials, confidence)
  g = int(group_size)

  def slack(eps):
    return (math.exp(g * eps) * null_success
            + g * math.exp((g - 1) * eps) * delta - p_lo)

  if slack(0.0) >= 0:
    return 0.0
  hi = 1.0
  while slack(hi) < 0:
    hi *= 2
  return float(optimize.brentq(slack, 0.0, hi, xtol=1e-12))


def one_run_bounds(rows: Sequence[dict], *, delta: float,
                   confidence: float = 0.95) -> dict:
  """jax-privacy's one-run ε estimators (`dpjax.audit.scores.lower_bound`,
  as the dialog membership study reports them) on canaries of ONE repetition
  count r: each canary's true secret (`score`, trained on: IN) against its
  first candidate secret (`candidate_score`, never trained on: OUT).
  Returns `epsilon_lower_bound_one_run` (f-DP, Mahloujifar et al., arXiv
  2410.22235) and `epsilon_one_run` (Steinke, Nasr and Jagielski, NeurIPS
  2023, arXiv 2305.08846).

  Group size: the datasets that an IN/OUT pair tells apart differ by the
  canary's r rows removed and the candidate's r rows added, 2r add/remove
  steps, so the ε bounded is that of a group of 2r examples at `delta`
  (`summarize` passes the ledger's δ, as to `epsilon_lower_bound`), not the
  per-example ε that `epsilon_lower_bound` reports: group privacy makes a
  per-example (ε₁, δ) guarantee a (2r ε₁, 2r e^{(2r-1)ε₁} δ) one for the
  group, whose δ exceeds `delta`.

  Limits: a secret and a candidate drawn uniformly are exchangeable before
  training, so which of the two was inserted is a fair coin, and one
  candidate per canary keeps IN and OUT equally many, as the theorem's coins
  do in expectation. But the two coins of a pair are tied (exactly one is in)
  where the theorem wants independent ones, so the figure is a statistic
  comparable with the dialog study's, not a certified bound.
  """
  scores = np.array([r["score"] for r in rows]
                    + [r["candidate_score"] for r in rows])
  inserted = np.arange(len(scores)) < len(rows)  # the true secrets first
  bounds = audit_scores.lower_bound(scores, inserted, delta=delta,
                                    confidence=confidence)
  return {"epsilon_lower_bound_one_run": bounds["epsilon_lower_bound"],
          "epsilon_one_run": bounds["epsilon_one_run"]}


def audit(model_dir: str, canaries: Sequence[Canary], *,
          num_candidates: int = 1000, seed: int = 0,
          vocabulary_path: str | None = None, top_p: float = 0.8,
          temperature: float = 1.0, chunk_size: int = 256) -> list[dict]:
  """One row per canary: its rank, exposures and extraction (see above)
  under the T5 generator in `model_dir`."""
  config, params, meta = inference.load_trained(model_dir)
  vocabulary_path = (vocabulary_path or meta.tokenizer_files
                     .get("sentencepiece") or msmarco_tasks.DEFAULT_VOCABULARY_PATH)
  tokenizer = encoding.Tokenizer(vocabulary_path)
  lengths = meta.task_feature_lengths
  inputs = tokenizer([msmarco_tasks.INPUT_PREFIX + c.document for c in canaries],
                     lengths["inputs"])
  score = make_sequence_scorer(config)
  rng = np.random.default_rng(seed)
  rows = []
  for canary, prompt in zip(canaries, inputs):
    draws = rng.integers(SECRET_SPACE, size=num_candidates)
    draws[draws == int(canary.secret)] += 1  # a candidate is another string
    secrets = [canary.secret] + [f"{int(d) % SECRET_SPACE:0{SECRET_DIGITS}d}"
                                 for d in draws]
    targets = tokenizer([f"{canary.prefix} {s}" for s in secrets],
                        lengths["targets"])
    padded = -(-len(targets) // chunk_size) * chunk_size
    targets = np.concatenate([targets, np.repeat(targets[:1],
                                                 padded - len(targets), 0)])
    scores = np.concatenate([
        np.asarray(score(params, prompt, targets[s:s + chunk_size]))
        for s in range(0, padded, chunk_size)])[:len(secrets)]
    rows.append({**dataclasses.asdict(canary), "qids": len(canary.qids),
                 "score": float(scores[0]),
                 # The OUT score of `one_run_bounds`: one candidate, so
                 # IN and OUT are equally many.
                 "candidate_score": float(scores[1]),
                 **exposure(scores[0], scores[1:])})
  texts = tokenizer.decode
  key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
  sampled = texts(decoding.generate(config, params, inputs,
                                    max_length=lengths["targets"], rng=key,
                                    temperature=temperature, top_p=top_p))
  greedy = texts(decoding.generate(config, params, inputs,
                                   max_length=lengths["targets"], rng=None,
                                   greedy=True))
  for row, s, g in zip(rows, sampled, greedy):
    row.update(generated=s, generated_greedy=g,
               extracted=extracted(row["secret"], [s]),
               extracted_greedy=extracted(row["secret"], [g]))
  return rows


def summarize(rows: Sequence[dict], *, delta: float, num_candidates: int,
              max_better: int = 0, confidence: float = 0.95) -> list[dict]:
  """Table 7 per repetition count (all kinds pooled) and per (kind,
  repetitions): mean sample rank, mean exposures, extraction rates, and per
  repetition count the ε lower bound of the attack `better <= max_better`
  (`epsilon_lower_bound`, per example) and jax-privacy's one-run estimators
  (`one_run_bounds`, for a group of 2r examples), both at `delta` and
  `confidence` (recorded as `confidence`)."""
  out = []
  reps = sorted({r["repetitions"] for r in rows})
  for rep in reps:
    for kind in (None, *KINDS):
      group = [r for r in rows if r["repetitions"] == rep
               and kind in (None, r["kind"])]
      if not group:
        continue
      row = {"repetitions": rep, "kind": kind or "all", "canaries": len(group),
             "sample_rank": float(np.mean([r["sample_rank"] for r in group])),
             "exposure": float(np.mean([r["exposure"] for r in group])),
             "exposure_skewnorm": float(np.mean(
                 [r["exposure_skewnorm"] for r in group])),
             "extraction": float(np.mean([r["extracted"] for r in group])),
             "extraction_greedy": float(np.mean(
                 [r["extracted_greedy"] for r in group]))}
      if kind is None:
        row["epsilon_lower_bound"] = epsilon_lower_bound(
            sum(r["better"] <= max_better for r in group), len(group),
            null_success=(max_better + 1) / (num_candidates + 1), delta=delta,
            group_size=2 * rep, confidence=confidence)
        row.update(one_run_bounds(group, delta=delta, confidence=confidence),
                   confidence=confidence)
      out.append(row)
  return out


__all__ = ["KINDS", "REPETITIONS", "SECRET_SPACE", "Canary", "make_canaries",
           "insert_canaries", "load_canaries", "make_sequence_scorer",
           "exposure", "extracted", "clopper_pearson_lower",
           "epsilon_lower_bound", "one_run_bounds", "audit", "summarize"]
