"""The LiRa attack: perplexity-ratio scores against a per-token loop in
float64, success counts by hand, prompts written out by hand."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from dpjax.data.readers import multidogo
from dpjax.pipelines.dialog import lira
from dpjax.models import gpt2
from dpjax.data.text import redaction

CONFIG = gpt2.GPT2Config(vocab_size=40, n_positions=24, d_model=16, num_layers=1,
                         num_heads=2, dropout_rate=0.0)


# One forward of a single sequence, right-padded to n_positions (causal: the
# padding cannot affect the logits read at real positions).
_forward = jax.jit(lambda params, tokens: gpt2.GPT2(CONFIG).apply(
    {"params": params}, tokens))


@pytest.fixture(scope="module")
def models():
  return [gpt2.init_params(CONFIG, jax.random.PRNGKey(s), max_length=8)[0]
          for s in (0, 1)]


def _direct_mean_nll(params, context, continuation):
  """Σ -log P(x_t | c, x_<t) / |x|, one forward per prefix, log-softmax in
  float64. A sequence longer than n_positions loses its first tokens."""
  seq = list(context) + list(continuation)
  start = max(0, len(seq) - CONFIG.n_positions)
  total = 0.0
  for t in range(len(context), len(seq)):
    prefix = seq[start:t]
    padded = np.zeros((1, CONFIG.n_positions), np.int32)
    padded[0, :len(prefix)] = prefix
    logits = np.asarray(_forward(params, padded)[0, len(prefix) - 1], np.float64)
    log_probs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    total -= log_probs[seq[t]]
  return total / len(continuation)


def test_perplexity_ratio_matches_a_per_token_loop(models):
  target, ref = models
  rng = np.random.default_rng(0)
  contexts = [list(rng.integers(0, 40, n)) for n in (1, 5, 12, 3, 20)]
  continuations = [list(rng.integers(0, 40, n)) for n in (3, 1, 7, 0, 10)]
  # Row 5 is 30 tokens > n_positions 24: scored on its last 24.
  got_t = lira.continuation_nll(CONFIG, target, contexts, continuations,
                                pad_id=39, batch_size=2)
  got_r = lira.continuation_nll(CONFIG, ref, contexts, continuations,
                                pad_id=39, batch_size=2)
  assert math.isnan(got_t[3]) and math.isnan(got_r[3])  # empty continuation
  for i in (0, 1, 2, 4):
    want_t = _direct_mean_nll(target, contexts[i], continuations[i])
    want_r = _direct_mean_nll(ref, contexts[i], continuations[i])
    assert got_t[i] == pytest.approx(want_t, rel=1e-5)
    assert got_r[i] == pytest.approx(want_r, rel=1e-5)
    ratio = math.exp(want_t) / math.exp(want_r)  # PPL_target / PPL_ref
    assert lira.perplexity_ratio(got_t, got_r)[i] == pytest.approx(ratio, rel=1e-4)
    assert lira.lira_score(got_t, got_r)[i] == pytest.approx(1 / ratio, rel=1e-4)


def test_success_rates_by_hand():
  texts = ["cable bill", "", "my seat", "  ", "internet", "flight"]
  flagged = np.array([True, True, False, False, True, False])  # empties flagged too
  scores = np.array([0.5, 99.0, 3.0, 50.0, 2.0, 2.0])
  got = lira.success_rates(texts, flagged, scores=scores, top=2)
  # 4 non-empty; successes "cable bill", "internet"; the empty ones never count.
  assert (got["generations"], got["non_empty"], got["successes"]) == (6, 4, 2)
  assert got["success_rate"] == 0.5
  # Top 2 by score among the non-empty: "my seat" (3.0), then the first of the
  # tie at 2.0, "internet" (flagged).
  assert (got["top"], got["top_successes"], got["top_success_rate"]) == (2, 1, 0.5)
  none = lira.success_rates(["", " "], np.array([True, True]))
  assert none["non_empty"] == 0 and math.isnan(none["success_rate"])
  with pytest.raises(ValueError):
    lira.success_rates(texts, flagged[:3])


def test_conversation_prompts_by_hand():
  u = multidogo.Utterance
  conv = multidogo.Conversation("AIRLINE", "c1", (
      u(0, "customer", "hi"), u(1, "agent", "Hello! How may I help?"),
      u(2, "customer", "my seat"), u(3, "agent", "Sure.")))
  short = multidogo.Conversation("AIRLINE", "c2", (u(0, "agent", "Hi"),))
  got = lira.conversation_prompts([conv, short, conv], num_conversations=2,
                                  prompts_per_conversation=2)
  assert got == [
      "<_soc_> <AIRLINE> USR: hi <AIRLINE> SYS:",
      "<_soc_> <AIRLINE> USR: hi <AIRLINE> SYS: Hello! How may I help? "
      "<AIRLINE> USR:"]
  full = lira.conversation_prompts([conv], prompts_per_conversation=10,
                                   domain_tokens=False)
  assert full[-1] == "<_soc_> USR: hi SYS: Hello! How may I help? USR: my seat SYS:"
  assert len(full) == 3  # the last utterance is never a prompt's target
  text = multidogo.format_conversation(conv)
  assert all(text.startswith(p) for p in lira.conversation_prompts([conv]))


def test_until_stop():
  assert lira.until_stop([5, 6, 7, 8], [7, 9]) == [5, 6]
  assert lira.until_stop([9, 6], [7, 9]) == []
  assert lira.until_stop([5, 6], [7]) == [5, 6]


class _WordVocabulary:
  """One id per word: the control tokens, some words, EOS last."""
  WORDS = (*multidogo.CONTROL_TOKENS, "hi", "seat", "flight", "cable", "bill",
           "claim", "car", "please", "ok", "yes", "no", "the", "my", "a")

  def __init__(self):
    self.words = list(self.WORDS) + [
        f"w{i}" for i in range(CONFIG.vocab_size - len(self.WORDS) - 1)]
    self.eos_id = CONFIG.vocab_size - 1

  def encode(self, s):
    return [self.words.index(w) for w in s.split()]

  def decode(self, ids):
    ids = list(ids)
    ids = ids[:ids.index(self.eos_id)] if self.eos_id in ids else ids
    return " ".join(self.words[i] for i in ids)


class _StubPolicy(redaction.Policy):
  """Flags "cable"/"bill" for MEDIA and "claim"/"car" for INSURANCE."""
  domains = ("AIRLINE", "MEDIA", "INSURANCE")
  WORDS = {"MEDIA": {"cable", "bill"}, "INSURANCE": {"claim", "car"}, "AIRLINE": set()}

  def spans_batch(self, texts, domains=None):
    domains = self._check_domains(domains)
    return [[(0, len(t))] if any(w in self.WORDS[d] for d in domains
                                 for w in t.split()) else [] for t in texts]


def test_attack_counts_and_scores(models):
  target, ref = models
  vocab = _WordVocabulary()
  prompts = ["<_soc_> <AIRLINE> USR: hi <AIRLINE> SYS:", "<_soc_> <AIRLINE> SYS:"]
  refs = {"MEDIA": lira.Model(CONFIG, ref), "INSURANCE": lira.Model(CONFIG, target)}
  records, summary = lira.attack(
      lira.Model(CONFIG, target), refs, prompts, vocabulary=vocab,
      policies={"stub": _StubPolicy()}, num_samples=8, max_new_tokens=6,
      top_fraction=0.25, batch_size=5)
  assert len(records) == 16
  assert [r["prompt"] for r in records] == [prompts[0]] * 8 + [prompts[1]] * 8
  stops = set(lira.STOP_TOKENS) | {redaction.REDACTED}
  for r in records:
    assert not stops & set(r["text"].split())  # cut at stops, REDACTED banned
    assert r["continuation_tokens"] == len(r["text"].split())
  non_empty = [r for r in records if r["text"]]
  leaks = [r for r in non_empty
           if {"cable", "bill", "claim", "car"} & set(r["text"].split())]
  assert 0 < len(non_empty) < 16  # a random model often stops at once
  got = summary["stub"]["all"]
  assert (got["non_empty"], got["successes"]) == (len(non_empty), len(leaks))
  assert got["success_rate"] == pytest.approx(len(leaks) / len(non_empty))
  media = [r for r in non_empty if {"cable", "bill"} & set(r["text"].split())]
  assert summary["stub"]["MEDIA"]["successes"] == len(media)
  assert got["top"] == max(1, round(0.25 * len(non_empty)))
  # Scores are the NLLs' ratios; the reference equal to the target scores 1.
  r = non_empty[0]
  assert r["lira_score"]["INSURANCE"] == pytest.approx(1.0)
  assert r["lira_score"]["MEDIA"] == pytest.approx(
      math.exp(r["reference_nll"]["MEDIA"] - r["target_nll"]), rel=1e-6)
  context = [vocab.eos_id, *vocab.encode(r["prompt"])]
  assert r["target_nll"] == pytest.approx(_direct_mean_nll(
      target, context, vocab.encode(r["text"])), rel=1e-5)
