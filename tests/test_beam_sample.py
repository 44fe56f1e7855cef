"""Tests of multinomial beam search for GPT-2 (dpjax.generation.decoding.beam_sample_causal).

References: an explicit per-position sampling loop on the uncached model, a
brute-force beam search over Python lists (HF's rules, the model called on
full prefixes), transformers' own beam search on the same weights, and
numpy's sampling without replacement.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.generation import decoding
from dpjax.models import gpt2

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the transformers test never reaches the Hub
VOCAB = 97
PROMPTS = np.array([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0], [10, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([5, 2, 1], np.int32)
NEW = 8
BEAMS = 3
EOS = 2  # frequent in this model's beams: lists fill early, so the stopping rule matters
WIDTH = PROMPTS.shape[1] + NEW


@pytest.fixture(scope="module")
def tiny():
  """A tiny GPT-2 with randomized biases and larger weights, so that its
  next-token distributions are far from uniform and depend on the context
  (at GPT-2's init scale it repeats one token in every beam)."""
  cfg = gpt2.GPT2Config(vocab_size=VOCAB, n_positions=64, d_model=64, num_layers=2,
                        num_heads=4)
  params, _ = gpt2.init_params(cfg, jax.random.PRNGKey(0), max_length=8)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else 10 * x
            for x, k in zip(leaves, keys)]
  params = jax.tree.unflatten(treedef, leaves)
  params["token_embedder"]["embedding"] *= 0.3
  params["position_embedder"]["embedding"] *= 0.1
  return cfg, params


@functools.partial(jax.jit, static_argnums=0)
def forward(cfg, params, tokens):
  return gpt2.GPT2(cfg).apply({"params": params}, tokens)


def next_log_probs(cfg, params, prefixes, banned=()):
  """float64 log-probs `[len(prefixes), vocab]` of the token after each
  prefix (a list of ids; at most NEW of them), from the full uncached model."""
  buf = np.zeros((NEW, WIDTH), np.int32)  # one shape: one compilation
  for i, prefix in enumerate(prefixes):
    buf[i, :len(prefix)] = prefix
  logits = forward(cfg, params, buf)[np.arange(len(prefixes)), [len(p) - 1 for p in prefixes]]
  log_probs = np.asarray(jax.nn.log_softmax(logits), np.float64)
  log_probs[:, list(banned)] = -np.inf
  return log_probs


def brute_force_beams(cfg, params, prompt, eos_id, length_penalty=1.0, banned=(),
                      stop_early=True):
  """Hugging Face beam search (early_stopping=False) by explicit loops.

  Returns the finished hypotheses, best first: (normalized score, tokens).
  `stop_early=False` drops HF's stopping heuristic (to check that a test
  exercises it).
  """
  running = [(0.0, [])]  # (sum of log-probs, generated tokens)
  finished = []
  for step in range(NEW):
    log_probs = next_log_probs(cfg, params, [prompt + toks for _, toks in running], banned)
    candidates = [(score + log_probs[b, v], toks + [v])
                  for b, (score, toks) in enumerate(running) for v in range(VOCAB)]
    candidates.sort(key=lambda c: -c[0])  # stable: ties in (beam, token) order
    next_running = []
    for rank, (score, toks) in enumerate(candidates[:2 * BEAMS]):
      if toks[-1] == eos_id or step == NEW - 1:
        if rank < BEAMS:
          finished.append((score / len(toks) ** length_penalty, toks))
      elif len(next_running) < BEAMS:
        next_running.append((score, toks))
    finished = sorted(finished, key=lambda f: -f[0])[:BEAMS]
    running = next_running
    if not running or (stop_early and len(finished) == BEAMS and
                       running[0][0] / (step + 1) ** length_penalty <= finished[-1][0]):
      break
  return finished


def brute_force_arrays(cfg, params, eos_id, **kwargs):
  """All rows' finished hypotheses as `[b, beams, NEW]` tokens (padded with
  eos_id) and `[b, beams]` scores."""
  tokens = np.full((len(PROMPTS), BEAMS, NEW), eos_id, np.int64)
  scores = np.full((len(PROMPTS), BEAMS), -np.inf)
  for r, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
    for j, (score, toks) in enumerate(
        brute_force_beams(cfg, params, list(prompt[:length]), eos_id, **kwargs)):
      tokens[r, j, :len(toks)] = toks
      scores[r, j] = score
  return tokens, scores


def test_one_beam_is_plain_sampling(tiny):
  cfg, params = tiny
  kwargs = dict(max_new_tokens=NEW, temperature=1.3, top_k=40, top_p=0.95, eos_id=7,
                banned_ids=(11, 12))
  key = jax.random.PRNGKey(3)
  beam = decoding.beam_sample_causal(cfg, params, PROMPTS, LENGTHS, num_beams=1, rng=key,
                                     **kwargs)
  plain = decoding.generate_causal(cfg, params, PROMPTS, LENGTHS, rng=key, **kwargs)
  np.testing.assert_array_equal(beam, plain)

  # Plain sampling itself, by an explicit loop over positions on the
  # uncached model: position t's logits are sampled with the t-th key of the
  # rng's split chain, for the whole batch at once.
  buf = np.zeros((3, WIDTH), np.int32)
  buf[:, :PROMPTS.shape[1]] = PROMPTS
  out = np.full((3, NEW), kwargs["eos_id"], np.int32)
  done = np.zeros(3, bool)
  rng = key
  for t in range(PROMPTS.shape[1] + NEW - 1):
    rng, step_rng = jax.random.split(rng)
    logits = forward(cfg, params, buf)[:, t].at[:, [11, 12]].set(-jnp.inf)
    sampled = np.asarray(decoding.sample_logits(logits, step_rng, temperature=1.3, top_k=40,
                                                top_p=0.95))
    for r in range(3):
      column = t + 1 - LENGTHS[r]
      if 0 <= column < NEW and not done[r]:
        out[r, column] = buf[r, t + 1] = sampled[r]
        done[r] = sampled[r] == kwargs["eos_id"]
  np.testing.assert_array_equal(plain, out)
  assert not np.array_equal(out, np.full_like(out, 7))  # not trivially all EOS


@pytest.mark.parametrize("mode", ["greedy", "tiny_temperature"])
def test_matches_brute_force_beam_search(tiny, mode):
  """Beam search with per-row prompt lengths, without and with an EOS that
  ends hypotheses early (and stops rows early), and a length penalty; in the
  tiny-temperature limit the sampled candidates are the best ones, so
  beam_sample is beam search."""
  cfg, params = tiny
  temperature = 1e-5
  if mode == "greedy":
    run = functools.partial(decoding.beam_sample_causal, greedy=True, rng=None)
  else:
    run = functools.partial(decoding.beam_sample_causal, temperature=temperature,
                            rng=jax.random.PRNGKey(5))
  run = functools.partial(run, cfg, params, PROMPTS, LENGTHS, num_beams=BEAMS,
                          max_new_tokens=NEW, return_all=True)
  for eos_id, length_penalty in [(-1, 1.0), (EOS, 1.0), (EOS, 0.5)]:
    ref_tokens, ref_scores = brute_force_arrays(cfg, params, eos_id,
                                                length_penalty=length_penalty)
    tokens, scores = run(eos_id=eos_id, length_penalty=length_penalty)
    assert tokens.shape == (3, BEAMS, NEW) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, ref_tokens)
    if mode == "tiny_temperature":  # scores are sums of log-probs / temperature
      scores = np.asarray(scores, np.float64) * temperature
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-4)
    best = run(eos_id=eos_id, length_penalty=length_penalty, return_all=False)
    np.testing.assert_array_equal(best, ref_tokens[:, 0])
  # The EOS cases really end hypotheses early (padded with EOS), and HF's
  # stopping rule changes the outcome.
  ends = ref_tokens[:, :, :-1] == EOS
  assert ends.any()
  for r, j, c in zip(*np.nonzero(ends)):
    assert np.all(ref_tokens[r, j, c:] == EOS)
  assert not np.array_equal(brute_force_arrays(cfg, params, EOS)[0],
                            brute_force_arrays(cfg, params, EOS, stop_early=False)[0])


def test_beam_search_matches_transformers(tiny, tmp_path):
  """Plain beam search against transformers' `generate` (num_beams=3,
  do_sample=False) on the same weights, one row at a time (HF would pad
  prompts on the left)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from dpjax.pretrained import hf
  cfg, params = tiny
  hf.export_hf(params, cfg, tmp_path)
  model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
  for length_penalty in [1.0, 0.5]:
    ours = decoding.beam_sample_causal(cfg, params, PROMPTS, LENGTHS, num_beams=BEAMS,
                                       max_new_tokens=NEW, rng=None, greedy=True, eos_id=EOS,
                                       length_penalty=length_penalty)
    for r, length in enumerate(LENGTHS):
      with torch.no_grad():
        out = model.generate(torch.tensor(PROMPTS[r:r + 1, :length], dtype=torch.long),
                             attention_mask=torch.ones((1, length), dtype=torch.long),
                             num_beams=BEAMS, do_sample=False, max_new_tokens=NEW,
                             eos_token_id=EOS, pad_token_id=EOS, early_stopping=False,
                             length_penalty=length_penalty)
      theirs = np.full(NEW, EOS)
      theirs[:out.shape[1] - length] = out[0, length:].numpy()
      np.testing.assert_array_equal(ours[r], theirs, err_msg=f"row {r}")

def test_banned_ids_and_seeds(tiny):
  cfg, params = tiny
  # Near-uniform sampling (high temperature, both filters built), banning
  # the tokens greedy beam search likes best.
  greedy = decoding.beam_sample_causal(cfg, params, PROMPTS, LENGTHS, num_beams=BEAMS,
                                       max_new_tokens=NEW, rng=None, greedy=True, eos_id=-1,
                                       return_all=True)[0]
  values, counts = np.unique(np.asarray(greedy), return_counts=True)
  banned = tuple(int(v) for v in values[np.argsort(-counts)[:4]])
  sample = functools.partial(decoding.beam_sample_causal, cfg, params, PROMPTS, LENGTHS,
                             num_beams=BEAMS, max_new_tokens=NEW, temperature=50.0,
                             top_k=VOCAB, top_p=0.999, eos_id=-1, banned_ids=banned,
                             return_all=True)
  (a, a_scores), (b, _) = sample(rng=jax.random.PRNGKey(1)), sample(rng=jax.random.PRNGKey(1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, sample(rng=jax.random.PRNGKey(2))[0])
  assert not np.isin(a, banned).any() and len(np.unique(a)) > 15
  a_scores = np.asarray(a_scores)
  assert np.isfinite(a_scores).all() and np.all(np.diff(a_scores, axis=1) <= 0)
  for row in np.asarray(a):  # sampled without replacement: distinct hypotheses
    assert len({tuple(h) for h in row}) == BEAMS
  # top_k=1 still keeps 2 tokens per beam (HF's min_tokens_to_keep with
  # beams): every token is one of the 2 most likely allowed ones after its
  # prefix, and the second one does occur.
  tokens = np.asarray(sample(rng=jax.random.PRNGKey(3), top_k=1)[0])
  ranks = []
  for prompt, length, row in zip(PROMPTS, LENGTHS, tokens):
    for hyp in row:
      prefixes = [list(prompt[:length]) + list(hyp[:c]) for c in range(NEW)]
      order = np.argsort(-next_log_probs(cfg, params, prefixes, banned), axis=1)
      ranks += [int(np.nonzero(order[c] == hyp[c])[0][0]) for c in range(NEW)]
  assert set(ranks) == {0, 1}
  with pytest.raises(ValueError, match="return_all"):
    decoding.beam_sample_causal(cfg, params, PROMPTS, LENGTHS, num_beams=1, max_new_tokens=NEW,
                                rng=None, greedy=True, return_all=True)


def test_top_p_filter_min_keep():
  # Sorted: .97, .02, .01; p = .5 alone keeps .97, min_keep=2 adds .02.
  logits = jnp.log(jnp.array([[0.97, 0.01, 0.02]]))
  assert list(np.isfinite(decoding.top_p_filter(logits, 0.5)[0])) == [True, False, False]
  assert list(np.isfinite(decoding.top_p_filter(logits, 0.5, min_keep=2)[0])) == [
      True, False, True]


def test_candidates_are_sampled_without_replacement(tiny):
  """One new token, 2 beams: the 4 candidates all end, and the best
  hypothesis is the most likely of 4 tokens drawn without replacement from
  softmax(log-probs / temperature). Its distribution over many independent
  rows matches numpy's sampling without replacement."""
  cfg, params = tiny
  rows, temperature = 4000, 1.0
  prompts = np.full((rows, 1), 17, np.int32)
  best = decoding.beam_sample_causal(cfg, params, prompts, np.ones(rows, np.int32),
                                     num_beams=2, max_new_tokens=1, temperature=temperature,
                                     rng=jax.random.PRNGKey(0), eos_id=-1)[:, 0]
  log_probs = next_log_probs(cfg, params, [[17]])[0] / temperature
  probs = np.exp(log_probs - log_probs.max())
  probs /= probs.sum()
  rng = np.random.default_rng(0)
  draws = np.stack([rng.choice(VOCAB, size=4, replace=False, p=probs) for _ in range(20000)])
  ref = draws[np.arange(len(draws)), np.argmax(probs[draws], axis=1)]
  top = np.argsort(-probs)[:6]
  got_freq = np.array([(np.asarray(best) == v).mean() for v in top])
  ref_freq = np.array([(ref == v).mean() for v in top])
  assert ref_freq.sum() > 0.5  # the check covers most of the mass
  tolerance = 4 * np.sqrt(ref_freq * (1 - ref_freq) / rows) + 0.005
  np.testing.assert_array_less(np.abs(got_freq - ref_freq), tolerance)
  # Plain sampling (the first draw) would give a visibly different law.
  plain_freq = probs[top]
  assert np.abs(plain_freq - ref_freq).max() > 3 * tolerance.max()
