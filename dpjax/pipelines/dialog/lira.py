"""LiRa: the likelihood-ratio attack that tests a dialog model for domain
privacy (Kabra & Elenberg, "Domain Private Transformers", Sec. 3, 4, 6.3).

A model M_D is domain private for a prompt domain d_i if, prompted with
contexts c of d_i, it rarely generates text of another domain d_j; the
reference M_{D̄_j} is the same model trained on D̄_j = D without d_j. The
attack:

1. `conversation_prompts`: contexts of d_i's test conversations, each the
   conversation up to some utterance followed by the next speaker's tags
   (`<_soc_> <AIRLINE> USR: hi <AIRLINE> SYS:`), so the model writes the
   next utterance. The paper feeds 100 prompts: the first 10 of each of the
   first 10 test conversations.
2. `sample_continuations`: 10 samples per prompt from the target model with
   top-k 40, `<REDACTED>` banned, cut at the first control token (the
   paper's stopping criteria), all in fixed-shape jitted batches.
3. `continuation_nll`: the mean per-token negative log-likelihood of each
   continuation x given its context c (context tokens excluded), under the
   target and each reference model; PPL(x|c) = exp(that), one jitted forward
   per batch. `perplexity_ratio` = PPL_target(x|c) / PPL_ref(x|c).
4. `success_rates`: a generation succeeds (leaks) when a policy F_j of a
   domain j ≠ i flags it. The paper's rate is #success / #non-empty
   generations over ALL non-empty generations (Sec. 3 and 6.2: "recall the
   rate = #success / non-empty-generations"; its Figure 1); the ranking only
   selects the high-confidence examples of its Tables 2-3. Both are given:
   the rate over all non-empty generations, and the rate among the `top`
   best-ranked ones.

Ranking direction. Sec. 3 says "rank by PPL_target/PPL_ref and select the
highest ratios", but the LiRa scores of its Tables 2-3 (up to 81, on leaking
generations of the Public model) and the attack it cites (Carlini et al.:
text the target model finds far more likely than the reference) rank the
other way: a generation is suspicious when the target is much more confident
than the reference, i.e. when PPL_ref / PPL_target is high. `lira_score` is
that quotient, 1 / `perplexity_ratio`, and the top-ranked generations are
those with the highest score.

No TensorFlow: jax, numpy and the (pure Python) MultiDoGo formatting.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol, Sequence

import jax
import numpy as np

from dpjax.generation import decoding
from dpjax.data.readers import multidogo
from dpjax.models import gpt2
from dpjax.models.gpt2 import GPT2Config
from dpjax.data.text import redaction

STOP_TOKENS = tuple(t for t in multidogo.CONTROL_TOKENS if t != redaction.REDACTED)
PAPER_TOP_K = 40
PAPER_NUM_SAMPLES = 10


class Vocabulary(Protocol):
  """What the attack needs of a task vocabulary (`ByteLevelBPEVocabulary`)."""
  eos_id: int

  def encode(self, s: str) -> Sequence[int]:
    """The token ids of `s`."""

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`."""


def conversation_prompts(conversations: Sequence[multidogo.Conversation], *,
                         num_conversations: int = 10,
                         prompts_per_conversation: int = 10,
                         domain_tokens: bool = True) -> list[str]:
  """Contexts of the first `num_conversations` conversations, in order: for
  k = 1 .. min(prompts_per_conversation, utterances - 1), `<_soc_>`, the
  first k formatted utterances, then the tags of utterance k + 1 (its
  domain token and role). Formatting is `multidogo.format_conversation`'s,
  so a prompt is a prefix of the conversation's training text.
  """
  if num_conversations < 1 or prompts_per_conversation < 1:
    raise ValueError("num_conversations and prompts_per_conversation must be "
                     f">= 1, got {num_conversations}, {prompts_per_conversation}")
  prompts = []
  for c in conversations[:num_conversations]:
    prefix = f"{multidogo.domain_token(c.domain)} " if domain_tokens else ""
    turns = [f"{prefix}{multidogo.ROLE_TOKENS[u.role]} {u.text}" for u in c.utterances]
    for k in range(1, min(prompts_per_conversation, len(turns) - 1) + 1):
      tags = f"{prefix}{multidogo.ROLE_TOKENS[c.utterances[k].role]}"
      prompts.append(" ".join([multidogo.CONVERSATION_START, *turns[:k], tags]))
  return prompts


def until_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
  """The ids before the first stop id (all of them if none)."""
  ids = [int(i) for i in ids]
  stops = set(int(s) for s in stop_ids)
  return next((ids[:p] for p, i in enumerate(ids) if i in stops), ids)


def _right_padded(rows: Sequence[Sequence[int]], width: int, pad_id: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """`[n, width]` int32 rows (each keeps its last `width` ids) and lengths."""
  tokens = np.full((len(rows), width), pad_id, np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for r, ids in enumerate(rows):
    ids = list(ids)[-width:]
    tokens[r, :len(ids)], lengths[r] = ids, len(ids)
  return tokens, lengths


def sample_continuations(config: GPT2Config, params, contexts: Sequence[Sequence[int]],
                         *, num_samples: int = PAPER_NUM_SAMPLES,
                         max_new_tokens: int, stop_ids: Sequence[int],
                         banned_ids: Sequence[int] = (), pad_id: int,
                         top_k: int = PAPER_TOP_K, seed: int = 0,
                         batch_size: int = 64) -> list[list[int]]:
  """`num_samples` continuations of each context (context-major), each cut
  before its first stop id.

  Contexts are token ids (BOS first). They share one padded width, so
  generation compiles once: the longest context, at most
  `n_positions - max_new_tokens + 1`; a longer context keeps its end (the
  most recent turns). `decoding.generate_causal` stops a row at
  `stop_ids[0]`; the other stop ids are cut afterwards. Batch b draws from
  `fold_in(PRNGKey(seed), b)`.
  """
  if num_samples < 1 or not stop_ids:
    raise ValueError("need num_samples >= 1 and at least one stop id")
  rows = [c for c in contexts for _ in range(num_samples)]
  if not rows:
    return []
  width = min(max(len(r) for r in rows), config.n_positions - max_new_tokens + 1)
  if width < 1:
    raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a "
                     f"context in n_positions {config.n_positions}")
  tokens, lengths = _right_padded(rows, width, pad_id)
  out = []
  for b, (idx, real) in enumerate(gpt2.fixed_size_batches(len(rows), batch_size)):
    got = decoding.generate_causal(
        config, params, tokens[idx], lengths[idx], max_new_tokens=max_new_tokens,
        rng=jax.random.fold_in(jax.random.PRNGKey(seed), b), top_k=top_k,
        eos_id=int(stop_ids[0]), banned_ids=tuple(int(i) for i in banned_ids))
    out += [until_stop(g, stop_ids) for g in np.asarray(got)[:real]]
  return out


def continuation_nll(config: GPT2Config, params, contexts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]], *, pad_id: int,
                     batch_size: int = 64) -> np.ndarray:
  """float64 `[n]`: the mean NLL per token of each continuation x given its
  context c (log PPL(x|c); context tokens are not scored), NaN for an empty
  continuation. Rows `c + x` longer than `n_positions` keep their end; all
  rows share one width (one compilation per config)."""
  if len(contexts) != len(continuations):
    raise ValueError(f"{len(contexts)} contexts for {len(continuations)} continuations")
  if not contexts:
    return np.zeros(0)
  rows = [list(c) + list(x) for c, x in zip(contexts, continuations)]
  width = min(max(len(r) for r in rows), config.n_positions)
  tokens, lengths = _right_padded(rows, width, pad_id)
  steps = np.array([len(x) for x in continuations])
  if (steps >= width).any():
    raise ValueError(f"a continuation of {steps.max()} tokens leaves no context "
                     f"within n_positions {config.n_positions}")
  position = np.arange(width)[None, :]
  weights = ((position >= (lengths - steps)[:, None])
             & (position < lengths[:, None])).astype(np.float32)
  sums, counts = gpt2.nll_sums(config, params, tokens, weights,
                               batch_size=batch_size)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(counts > 0, sums / counts, np.nan)


def perplexity_ratio(target_nll: np.ndarray, reference_nll: np.ndarray) -> np.ndarray:
  """PPL_target(x|c) / PPL_ref(x|c) from the two mean NLLs."""
  return np.exp(np.asarray(target_nll, np.float64) - np.asarray(reference_nll, np.float64))


def lira_score(target_nll: np.ndarray, reference_nll: np.ndarray) -> np.ndarray:
  """PPL_ref(x|c) / PPL_target(x|c): high when the target model is far more
  confident than the reference (the ranking; see the module docstring)."""
  return 1.0 / perplexity_ratio(target_nll, reference_nll)


def success_rates(texts: Sequence[str], flagged: np.ndarray, *,
                  scores: np.ndarray | None = None, top: int | None = None) -> dict:
  """The attack's success counts over non-empty generations.

  Args:
    texts: the generations (empty or whitespace-only ones are excluded).
    flagged: `[n]` bool: the generation holds text of another domain.
    scores: `[n]` LiRa scores (higher = more suspicious); with `top`, also
      the rate among the `top` highest-scored non-empty generations (ties:
      earlier generation first).

  Returns:
    {"generations", "non_empty", "successes", "success_rate" (NaN if no
    generation is non-empty)} and, with `top`, {"top", "top_successes",
    "top_success_rate"}.
  """
  flagged = np.asarray(flagged, bool)
  if flagged.shape != (len(texts),):
    raise ValueError(f"flagged has shape {flagged.shape}, expected ({len(texts)},)")
  non_empty = np.array([bool(t.strip()) for t in texts], bool)
  hits = flagged & non_empty
  n = int(non_empty.sum())
  out = {"generations": len(texts), "non_empty": n, "successes": int(hits.sum()),
         "success_rate": hits.sum() / n if n else math.nan}
  if top is not None:
    if scores is None or top < 1:
      raise ValueError("the top-ranked rate needs scores and top >= 1")
    candidates = np.flatnonzero(non_empty)
    order = candidates[np.argsort(-np.asarray(scores, np.float64)[candidates],
                                  kind="stable")][:top]
    out.update(top=len(order), top_successes=int(hits[order].sum()),
               top_success_rate=hits[order].mean() if len(order) else math.nan)
  return out


@dataclasses.dataclass(frozen=True)
class Model:
  """A GPT-2 to attack, or a reference model: its config and params."""
  config: GPT2Config
  params: object


def attack(target: Model, references: Mapping[str, Model], prompts: Sequence[str],
           *, vocabulary: Vocabulary, policies: Mapping[str, redaction.Policy],
           num_samples: int = PAPER_NUM_SAMPLES, max_new_tokens: int = 64,
           top_k: int = PAPER_TOP_K, top_fraction: float = 0.1, seed: int = 0,
           batch_size: int = 64) -> tuple[list[dict], dict]:
  """The LiRa attack on `target` with prompts of one domain d_i.

  Args:
    target: the model under attack.
    references: {d_j: M_{D̄_j}} for each other domain d_j (the domains a
      generation must not leak into), on the target's vocabulary.
    prompts: context texts of d_i (`conversation_prompts`).
    vocabulary: the task vocabulary with `CONTROL_TOKENS`; BOS = its EOS id.
    policies: {name: policy}; a generation succeeds under a policy when it
      flags it for some d_j (`policy.flags_batch(texts, [d_j])`).
    num_samples, max_new_tokens, top_k, seed, batch_size: the sampling.
    top_fraction: the top-ranked rate covers this fraction of the non-empty
      generations (at least one).

  Returns:
    (records, summary). One record per generation: prompt, text,
    continuation token count, target NLL and per d_j reference NLL, LiRa
    score and the flags {policy: {d_j: bool}}. Summary per policy:
    `success_rates` overall (flagged for any d_j, ranked by the highest
    score over the d_j) and per d_j (flagged for d_j, ranked by d_j's score).
  """
  stop_ids = [_single_id(vocabulary, t) for t in STOP_TOKENS] + [vocabulary.eos_id]
  banned = [_single_id(vocabulary, redaction.REDACTED)]
  bos = vocabulary.eos_id
  contexts = [[bos, *vocabulary.encode(p)] for p in prompts]
  kw = dict(pad_id=bos, batch_size=batch_size)
  generated = sample_continuations(
      target.config, target.params, contexts, num_samples=num_samples,
      max_new_tokens=max_new_tokens, stop_ids=stop_ids, banned_ids=banned,
      top_k=top_k, seed=seed, **kw)
  # Each generation scored after the context it was sampled from.
  width = min(max(len(c) for c in contexts), target.config.n_positions - max_new_tokens + 1)
  row_contexts = [c[-width:] for c in contexts for _ in range(num_samples)]
  texts = [" ".join(vocabulary.decode(g).split()) for g in generated]
  target_nll = continuation_nll(target.config, target.params, row_contexts, generated, **kw)
  ref_nll = {d: continuation_nll(m.config, m.params, row_contexts, generated, **kw)
             for d, m in references.items()}
  scores = {d: lira_score(target_nll, r) for d, r in ref_nll.items()}
  flags = {name: {d: np.asarray(p.flags_batch(texts, [d]), bool) for d in references}
           for name, p in policies.items()}
  n_top = max(1, round(top_fraction * sum(bool(t.strip()) for t in texts)))
  best = np.fmax.reduce(np.stack(list(scores.values())), axis=0) if scores else None
  summary = {}
  for name, by_domain in flags.items():
    any_flag = np.any(np.stack(list(by_domain.values())), axis=0)
    summary[name] = {
        "all": success_rates(texts, any_flag, scores=best, top=n_top),
        **{d: success_rates(texts, f, scores=scores[d], top=n_top)
           for d, f in by_domain.items()}}
  records = [{
      "prompt": prompts[r // num_samples], "text": texts[r],
      "continuation_tokens": len(generated[r]),
      "target_nll": _float(target_nll[r]),
      "reference_nll": {d: _float(v[r]) for d, v in ref_nll.items()},
      "lira_score": {d: _float(v[r]) for d, v in scores.items()},
      "flags": {name: {d: bool(f[r]) for d, f in by.items()}
                for name, by in flags.items()},
  } for r in range(len(texts))]
  return records, summary


def _single_id(vocabulary: Vocabulary, token: str) -> int:
  ids = list(vocabulary.encode(token))
  if len(ids) != 1:
    raise ValueError(f"{token!r} is not one token of the vocabulary (encodes as "
                     f"{ids}); use tasks.multidogo.dialog_vocabulary")
  return int(ids[0])


def _float(x) -> float | None:
  """JSON-safe: NaN becomes None."""
  return None if not np.isfinite(x) else float(x)


__all__ = ["STOP_TOKENS", "PAPER_TOP_K", "PAPER_NUM_SAMPLES", "Model",
           "conversation_prompts", "until_stop", "sample_continuations",
           "continuation_nll", "perplexity_ratio", "lira_score",
           "success_rates", "attack"]
