"""Autoregressive generation with a key/value cache: T5 and GPT-2.

`generate` (T5): the encoder runs once; a `jax.lax.while_loop` then feeds one
token per step through the decoder's cached self-attention. `generate_causal`
(GPT-2) feeds the prompt through the same kind of loop and then continues it.
Tokens are sampled with temperature, top-k and nucleus (top-p) filtering, or
greedily. `beam_sample_causal` (GPT-2) is Hugging Face's multinomial beam
search over the same loop, with one cache row per beam. Shapes are static
(lengths and which filters are on are static jit arguments), so each compiles
once per (config, batch shape, settings).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from dpjax.models.gpt2 import GPT2, GPT2Config
from dpjax.models.t5 import T5Config, T5Transformer

Array = jax.Array


def _ordered_bits(x: Array) -> Array:
  """float32 -> uint32 with the same order (-inf lowest; -0 = 0, as `<` has
  it; NaN not expected)."""
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  sign = jnp.uint32(1 << 31)
  return jnp.where(bits >= sign, ~bits, bits | sign)


def top_k_filter(logits: Array, k: int | Array) -> Array:
  """Keeps exactly the `k` largest logits per row (ties: lowest index first);
  the rest become -inf. `k` may be traced (no recompilation per k).

  No sort: the k-th largest value of each row is found bit by bit on the
  float's order-preserving uint32 key (32 counting passes over the row), so
  a `[rows, vocab]` filter costs O(32 x rows x vocab) elementwise work. On 2
  CPU cores a [320, 1979] row block takes ~10 ms this way and ~130 ms by a
  stable argsort, which dominated every beam-search step with top_k = 50.
  """
  keys = _ordered_bits(logits)
  k = jnp.asarray(k, jnp.int32)

  def next_bit(i, threshold):  # largest key T with #(keys >= T) >= k so far
    candidate = threshold | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    enough = jnp.sum(keys >= candidate[..., None], axis=-1) >= k
    return jnp.where(enough, candidate, threshold)

  kth = jax.lax.fori_loop(0, 32, next_bit,
                          jnp.zeros(logits.shape[:-1], jnp.uint32))[..., None]
  above = keys > kth
  ties = keys == kth  # the first k - #above of them, by index
  room = k - jnp.sum(above, axis=-1, keepdims=True)
  keep = above | (ties & (jnp.cumsum(ties, axis=-1) <= room))
  return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits: Array, p: float | Array, min_keep: int = 1) -> Array:
  """Nucleus filter: keeps the smallest set of most likely tokens whose
  probabilities sum to at least `p` (always at least the `min_keep` most
  likely; ties: lowest index first); the rest become -inf. `p` may be
  traced.

  No sort, as `top_k_filter`: the logit of the nucleus's last token is the
  largest key T whose tokens at or above it hold mass >= p, found bit by bit
  (32 masked sums over the row); tokens above it are kept, and tokens tied
  with it by index while the mass before them is < p.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  keys = _ordered_bits(logits)

  def mass(selected):
    return jnp.sum(jnp.where(selected, probs, 0.0), axis=-1, keepdims=True)

  p = jnp.broadcast_to(jnp.asarray(p, jnp.float32),
                       jnp.broadcast_shapes(jnp.shape(p), logits.shape[:-1] + (1,)))

  def next_bit(i, threshold):  # largest key T with mass(keys >= T) >= p so far
    candidate = threshold | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    return jnp.where(mass(keys >= candidate) >= p, candidate, threshold)

  last = jax.lax.fori_loop(0, 32, next_bit,  # [..., 1]
                           jnp.zeros(p.shape, jnp.uint32))
  above, ties = keys > last, keys == last
  mass_before_tie = mass(above) + (jnp.cumsum(ties, axis=-1) - 1) * probs
  keep = above | (ties & (mass_before_tie < p))
  if min_keep == 1:  # p <= 0 keeps no tie: the top token still stays
    keep |= jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1],
                           dtype=bool)
  else:
    keep |= jnp.isfinite(top_k_filter(logits, min_keep))
  return jnp.where(keep, logits, -jnp.inf)


def _warp(scores: Array, *, temperature: float | Array, top_k: int | Array,
          top_p: float | Array, use_top_k: bool, use_top_p: bool,
          min_keep: int = 1) -> Array:
  """Divides `[b, vocab]` scores by the temperature, then applies the top-k
  and top-p filters (filtered entries become -inf; each keeps at least
  `min_keep` tokens), in float32.

  Scores may be logits or log-probabilities: both filters only depend on
  softmax(scores / temperature), which is the same for either.
  """
  scores = scores.astype(jnp.float32) / temperature
  if use_top_k:
    scores = top_k_filter(scores, jnp.maximum(top_k, min_keep))
  if use_top_p:
    scores = top_p_filter(scores, top_p, min_keep)
  return scores


def sample_logits(logits: Array, rng: Array, *, temperature: float | Array = 1.0,
                  top_k: int | Array = 0, top_p: float | Array = 1.0,
                  greedy: bool = False, use_top_k: bool | None = None,
                  use_top_p: bool | None = None) -> Array:
  """Draws one token id per row of `[b, vocab]` logits.

  Like Hugging Face's samplers: temperature, then top-k, then top-p on the
  renormalized top-k distribution. `use_top_k` / `use_top_p` (static) say
  whether each filter is built at all; by default they follow `top_k > 0`
  and `top_p < 1`, which then must be concrete.
  """
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  use_top_k = top_k > 0 if use_top_k is None else use_top_k
  use_top_p = top_p < 1.0 if use_top_p is None else use_top_p
  logits = _warp(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                 use_top_k=use_top_k, use_top_p=use_top_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "config", "max_length", "greedy", "use_top_k", "use_top_p"))
def _generate(config, params, encoder_input_tokens, rng, temperature, top_k, top_p, eos_id, *,
              max_length, greedy, use_top_k, use_top_p):
  model = T5Transformer(config)
  batch = encoder_input_tokens.shape[0]
  encoded = model.apply({"params": params}, encoder_input_tokens, method=T5Transformer.encode)

  def decode_step(cache, tokens):
    logits, state = model.apply(
        {"params": params, "cache": cache}, encoded, encoder_input_tokens, tokens,
        decode=True, max_decode_length=max_length, mutable=["cache"],
        method=T5Transformer.decode)
    return logits, state["cache"]

  # The cache-creating call (full length): self-attention caches and the
  # position index start at zero; cross-attention keys/values are projected
  # from the encodings once, here, and reused at every step.
  _, state = model.apply(
      {"params": params}, encoded, encoder_input_tokens,
      jnp.zeros((batch, max_length), jnp.int32), decode=True,
      max_decode_length=max_length, mutable=["cache"],
      method=T5Transformer.decode)
  cache = state["cache"]

  def cond(state):
    step, _, _, _, done, _ = state
    return (step < max_length) & ~jnp.all(done)

  def body(state):
    step, out, cache, rng, done, prev = state
    logits, cache = decode_step(cache, prev[:, None])
    rng, sample_rng = jax.random.split(rng)
    token = sample_logits(logits[:, 0], sample_rng, temperature=temperature, top_k=top_k,
                          top_p=top_p, greedy=greedy, use_top_k=use_top_k,
                          use_top_p=use_top_p)
    token = jnp.where(done, 0, token)  # finished rows emit padding
    out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
    return step + 1, out, cache, rng, done | (token == eos_id), token

  start = jnp.zeros((batch,), jnp.int32)  # decoder start token = 0
  init = (jnp.array(0, jnp.int32), jnp.zeros((batch, max_length), jnp.int32), cache, rng,
          jnp.zeros((batch,), bool), start)
  return jax.lax.while_loop(cond, body, init)[1]


def generate(config: T5Config, params, encoder_input_tokens: Array, *, max_length: int,
             rng: Array | None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             greedy: bool = False, eos_id: int = 1) -> Array:
  """Generates `[b, max_length]` int32 tokens for each encoder input row.

  The output excludes the start token and includes EOS; positions after a
  row's EOS (or never reached, once every row has stopped) are 0. `rng` may
  be None for greedy decoding. `greedy=True` (or `temperature=0`) takes the
  argmax; otherwise tokens are sampled from softmax(logits / temperature)
  after optional top-k (k > 0) and top-p (p < 1) filtering.

  Compiles once per (config, input shape, max_length, greedy, whether top-k
  and whether top-p are on); the values of temperature, top_k, top_p and
  eos_id are runtime arguments.
  """
  greedy = bool(greedy) or temperature == 0
  if rng is None:
    if not greedy:
      raise ValueError("Sampling needs an rng; pass greedy=True for argmax decoding.")
    rng = jax.random.PRNGKey(0)
  return _generate(config, params, jnp.asarray(encoder_input_tokens, jnp.int32), rng,
                   jnp.float32(1.0 if greedy else temperature), jnp.int32(top_k),
                   jnp.float32(top_p), jnp.int32(eos_id), max_length=int(max_length),
                   greedy=greedy, use_top_k=not greedy and top_k > 0,
                   use_top_p=not greedy and top_p < 1.0)


def _causal_stepper(config: GPT2Config, params, batch: int, num_positions: int):
  """`(cache, step)`: a zero KV cache for `batch` rows of `num_positions`, and
  `step(cache, tokens [batch]) -> (logits [batch, vocab], cache)` feeding one
  token per row at the cache index."""
  model = GPT2(config)

  def step(cache, tokens):
    logits, state = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                decode=True, mutable=["cache"])
    return logits[:, 0], state["cache"]

  # Every cache entry (keys, values, index) starts at zero: only shapes needed.
  cache_shapes = jax.eval_shape(lambda: model.apply(
      {"params": params}, jnp.zeros((batch, num_positions), jnp.int32), decode=True,
      mutable=["cache"])[1]["cache"])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes), step


def _prompt_token(prompt_tokens: Array, position: Array) -> Array:
  """`prompt_tokens[:, position]` for a traced position (clamped to the width)."""
  return jax.lax.dynamic_index_in_dim(
      prompt_tokens, jnp.minimum(position, prompt_tokens.shape[1] - 1), axis=1, keepdims=False)


@functools.partial(jax.jit, static_argnames=(
    "config", "max_new_tokens", "greedy", "use_top_k", "use_top_p"))
def _generate_causal(config, params, prompt_tokens, prompt_lengths, rng, temperature, top_k,
                     top_p, eos_id, banned_ids, *, max_new_tokens, greedy, use_top_k,
                     use_top_p):
  batch, prompt_width = prompt_tokens.shape
  # A row with prompt length p feeds positions 0..p+max_new_tokens-2 (its last
  # token is never fed back), so the widest prompt bounds the cache.
  num_positions = prompt_width + max_new_tokens - 1
  lengths = jnp.clip(prompt_lengths, 1, prompt_width)
  cache, decode_step = _causal_stepper(config, params, batch, num_positions)
  columns = jnp.arange(max_new_tokens)

  def cond(state):
    t, _, _, _, _, done = state
    return (t < num_positions) & ~jnp.all(done)

  def body(state):
    # Position t holds `token`; its logits predict position t + 1.
    t, token, cache, rng, out, done = state
    logits, cache = decode_step(cache, token)
    if banned_ids.shape[0]:
      logits = logits.at[:, banned_ids].set(-jnp.inf)
    rng, sample_rng = jax.random.split(rng)
    sampled = sample_logits(logits, sample_rng, temperature=temperature, top_k=top_k,
                            top_p=top_p, greedy=greedy, use_top_k=use_top_k,
                            use_top_p=use_top_p)
    column = t + 1 - lengths  # output index of position t + 1; < 0 inside the prompt
    write = (column >= 0) & ~done
    out = jnp.where(write[:, None] & (columns == column[:, None]), sampled[:, None], out)
    done = done | (write & ((sampled == eos_id) | (column == max_new_tokens - 1)))
    # Teacher forcing inside the prompt, then feed back the sample.
    token = jnp.where(t + 1 < lengths, _prompt_token(prompt_tokens, t + 1), sampled)
    return t + 1, token, cache, rng, out, done

  init = (jnp.array(0, jnp.int32), prompt_tokens[:, 0], cache, rng,
          jnp.full((batch, max_new_tokens), eos_id, jnp.int32), jnp.zeros((batch,), bool))
  return jax.lax.while_loop(cond, body, init)[4]


def _check_causal_args(config: GPT2Config, prompt_tokens: Array, max_new_tokens: int,
                       banned_ids: Sequence[int], greedy: bool, rng: Array | None) -> Array:
  """Validates the arguments shared by the GPT-2 decoders; returns the rng."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}.")
  if prompt_tokens.shape[1] + max_new_tokens - 1 > config.n_positions:
    raise ValueError(f"Prompt width {prompt_tokens.shape[1]} + max_new_tokens "
                     f"{max_new_tokens} - 1 exceeds n_positions {config.n_positions}.")
  if any(not 0 <= i < config.vocab_size for i in banned_ids):
    raise ValueError(f"banned_ids {list(banned_ids)} outside the vocabulary.")
  if rng is None:
    if not greedy:
      raise ValueError("Sampling needs an rng; pass greedy=True for argmax decoding.")
    rng = jax.random.PRNGKey(0)
  return rng


def generate_causal(config: GPT2Config, params, prompt_tokens: Array, prompt_lengths: Array,
                    *, max_new_tokens: int, rng: Array | None, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                    eos_id: int = 50256, banned_ids: Sequence[int] = ()) -> Array:
  """Continues each prompt with `[b, max_new_tokens]` int32 tokens (GPT-2).

  Prompts are right-padded: row r is `prompt_tokens[r, :prompt_lengths[r]]`
  (lengths are clipped to `[1, P]`; GPT-2 needs at least one token, e.g.
  `<|endoftext|>`). All rows step through the cache together, one position
  per step; a row feeds its own prompt until its length, then its samples,
  so its output starts right after its prompt. The output includes EOS;
  positions after a row's EOS are `eos_id` (GPT-2 has no padding id).
  `banned_ids` get -inf logits, so they are never generated. Sampling is as
  in `generate`; `rng` may be None for greedy decoding. Needs
  `P + max_new_tokens - 1 <= config.n_positions`.

  Compiles once per (config, prompt shape, max_new_tokens, number of banned
  ids, greedy, whether top-k and whether top-p are on).
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  greedy = bool(greedy) or temperature == 0
  rng = _check_causal_args(config, prompt_tokens, max_new_tokens, banned_ids, greedy, rng)
  return _generate_causal(
      config, params, prompt_tokens, jnp.asarray(prompt_lengths, jnp.int32), rng,
      jnp.float32(1.0 if greedy else temperature), jnp.int32(top_k), jnp.float32(top_p),
      jnp.int32(eos_id), jnp.asarray(list(banned_ids), jnp.int32),
      max_new_tokens=int(max_new_tokens), greedy=greedy, use_top_k=not greedy and top_k > 0,
      use_top_p=not greedy and top_p < 1.0)


# ----------------------------------------------------------------------------
# Multinomial beam search (Hugging Face's `beam_sample`) for GPT-2.
# ----------------------------------------------------------------------------


def _gather_beams(x: Array, index: Array) -> Array:
  """`x[r, index[r, j]]`: `[b, n, ...]` gathered by `[b, k]` -> `[b, k, ...]`."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@functools.partial(jax.jit, static_argnames=(
    "config", "num_beams", "max_new_tokens", "greedy", "use_top_k", "use_top_p"))
def _beam_sample_causal(config, params, prompt_tokens, prompt_lengths, rng, temperature, top_k,
                        top_p, eos_id, banned_ids, length_penalty, *, num_beams,
                        max_new_tokens, greedy, use_top_k, use_top_p):
  batch, prompt_width = prompt_tokens.shape
  beams, vocab, num_candidates = num_beams, config.vocab_size, 2 * num_beams
  num_positions = prompt_width + max_new_tokens - 1  # as in _generate_causal
  lengths = jnp.clip(prompt_lengths, 1, prompt_width)
  # The cache holds batch * beams rows, beam-major within each batch row.
  cache, decode_step = _causal_stepper(config, params, batch * beams, num_positions)
  columns = jnp.arange(max_new_tokens)
  in_top_beams = jnp.arange(num_candidates) < beams

  def cond(state):
    return (state[0] < num_positions) & ~jnp.all(state[-1])

  def body(state):
    # Position t holds `token` [b, beams]; its logits predict position t + 1.
    t, token, cache, rng, seqs, scores, final_seqs, final_scores, done = state
    logits, cache = decode_step(cache, token.reshape(-1))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if banned_ids.shape[0]:
      log_probs = log_probs.at[:, banned_ids].set(-jnp.inf)
    if not greedy:  # HF warps the log-probs (no renormalization), keeping a
      # non-EOS token beside a possible EOS in every beam.
      log_probs = _warp(log_probs, temperature=temperature, top_k=top_k, top_p=top_p,
                        use_top_k=use_top_k, use_top_p=use_top_p, min_keep=2)
    # Running score of every (beam, token) continuation, flat per batch row.
    totals = (scores[:, :, None] + log_probs.reshape(batch, beams, vocab)).reshape(batch, -1)
    rng, sample_rng = jax.random.split(rng)  # one key per position, as _generate_causal
    if greedy:
      candidates = jax.lax.top_k(totals, num_candidates)[1]
    else:  # softmax(totals) sampled without replacement (Gumbel top-k)
      candidates = jax.random.categorical(sample_rng, totals, shape=(num_candidates, batch),
                                          replace=False).T
    # Candidates ranked by score, best first (ties: lower flat index).
    cand_scores, order = jax.lax.top_k(jnp.take_along_axis(totals, candidates, axis=1),
                                       num_candidates)
    candidates = jnp.take_along_axis(candidates, order, axis=1)
    parents, cand_tokens = candidates // vocab, candidates % vocab
    column = t + 1 - lengths  # output index of position t + 1; < 0 inside the prompt
    cand_seqs = jnp.where(columns == column[:, None, None], cand_tokens[..., None],
                          _gather_beams(seqs, parents))
    active = (column >= 0) & ~done
    ends = (cand_tokens == eos_id) | (column == max_new_tokens - 1)[:, None]

    # Ending candidates ranked among the best `beams` join the finished list
    # with their length-normalized score; it keeps the best `beams`, sorted.
    norm = jnp.maximum(column + 1, 1).astype(jnp.float32)[:, None] ** length_penalty
    joins = active[:, None] & ends & in_top_beams & (cand_scores > -jnp.inf)
    merged = jnp.concatenate([final_scores, jnp.where(joins, cand_scores / norm, -jnp.inf)],
                             axis=1)
    final_scores, keep = jax.lax.top_k(merged, beams)  # ties keep the older entries
    final_seqs = _gather_beams(jnp.concatenate([final_seqs, cand_seqs], axis=1), keep)

    # The best `beams` candidates that did not end continue (fewer finite
    # ones leave beams at -inf, which never produce finite candidates).
    next_scores, picked = jax.lax.top_k(jnp.where(ends, -jnp.inf, cand_scores), beams)
    stay = ~active[:, None]  # rows inside their prompt or done keep their beams
    sources = jnp.where(stay, jnp.arange(beams), _gather_beams(parents, picked))
    scores = jnp.where(stay, scores, next_scores)
    seqs = jnp.where(stay[..., None], seqs, _gather_beams(cand_seqs, picked))
    rows = jnp.arange(batch)[:, None] * beams + sources
    cache = jax.tree.map(lambda x: jnp.take(x, rows.reshape(-1), axis=0) if x.ndim else x, cache)

    # HF's stopping rule (early_stopping=False): a row is done once its list
    # is full and the best running score, normalized by the current length,
    # cannot beat the worst finished one; or at max length; or with no
    # finite beam left.
    cannot_improve = (final_scores[:, -1] > -jnp.inf) & (
        scores[:, 0] / norm[:, 0] <= final_scores[:, -1])
    done = done | (active & (cannot_improve | (column == max_new_tokens - 1)
                             | (scores[:, 0] == -jnp.inf)))
    # Teacher forcing inside the prompt, then each beam's last token.
    token = jnp.where((t + 1 < lengths)[:, None], _prompt_token(prompt_tokens, t + 1)[:, None],
                      _gather_beams(cand_tokens, picked))
    return t + 1, token, cache, rng, seqs, scores, final_seqs, final_scores, done

  # Beams start as copies of the prompt; only the first is live (score 0),
  # so the first step does not draw the same continuation once per beam.
  empty = jnp.full((batch, beams, max_new_tokens), eos_id, jnp.int32)
  first_live = jnp.where(jnp.arange(beams) == 0, 0.0, -jnp.inf).astype(jnp.float32)
  init = (jnp.array(0, jnp.int32), jnp.repeat(prompt_tokens[:, :1], beams, axis=1), cache, rng,
          empty, jnp.broadcast_to(first_live, (batch, beams)), empty,
          jnp.full((batch, beams), -jnp.inf, jnp.float32), jnp.zeros((batch,), bool))
  final = jax.lax.while_loop(cond, body, init)
  return final[6], final[7]


def beam_sample_causal(config: GPT2Config, params, prompt_tokens: Array,
                       prompt_lengths: Array, *, num_beams: int, max_new_tokens: int,
                       rng: Array | None, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, greedy: bool = False, eos_id: int = 50256,
                       banned_ids: Sequence[int] = (), length_penalty: float = 1.0,
                       return_all: bool = False) -> Array | tuple[Array, Array]:
  """Multinomial beam search (Hugging Face's `beam_sample`) for GPT-2.

  Prompts, `eos_id`, `banned_ids`, the output layout and the limits are as
  in `generate_causal`. Each batch row keeps `num_beams` running beams,
  scored by the sum of their processed token log-probs: log-softmax of the
  logits, banned ids at -inf, then temperature, top-k and top-p as in
  `sample_logits` but keeping at least 2 tokens per beam (HF's
  `min_tokens_to_keep`), not renormalized (as in HF). At each step, among all
  `num_beams * vocab` continuations of a row, `2 * num_beams` candidates
  are sampled without replacement from softmax(beam score + processed
  log-prob) (`greedy=True`: the best `2 * num_beams`, plain beam search) and
  ranked by that score. Candidates that end (EOS, or the last of the
  `max_new_tokens` positions) and rank among the first `num_beams` join the
  row's list of `num_beams` finished hypotheses, scored by sum /
  generated_length ** length_penalty (EOS counted); the best `num_beams`
  candidates that did not end become the next beams, and the KV cache rows
  are reordered to follow their parents. A row stops once its list is full
  and its best running beam, normalized by the current length, scores no
  better than the worst finished hypothesis (HF's `early_stopping=False`).

  `num_beams=1` is plain sampling: it returns `generate_causal` with the same
  arguments and rng, bit for bit. (HF dispatches one-beam sampling to its
  sampler, too; keeping the better of two draws would not be sampling.)

  Returns the best hypothesis per row, `[b, max_new_tokens]` int32; with
  `return_all=True` (needs `num_beams > 1`) the whole finished lists instead,
  best first: tokens `[b, num_beams, max_new_tokens]` and their normalized
  scores `[b, num_beams]` (-inf for slots never filled, e.g. when filters
  leave fewer than `2 * num_beams` finite candidates).

  Compiles once per (config, prompt shape, num_beams, max_new_tokens, number
  of banned ids, greedy, whether top-k and whether top-p are on).
  """
  if num_beams < 1:
    raise ValueError(f"num_beams must be positive, got {num_beams}.")
  if return_all and num_beams == 1:
    raise ValueError("return_all needs num_beams > 1: one beam is plain sampling, "
                     "which keeps no hypothesis list.")
  if num_beams == 1:
    return generate_causal(config, params, prompt_tokens, prompt_lengths,
                           max_new_tokens=max_new_tokens, rng=rng, temperature=temperature,
                           top_k=top_k, top_p=top_p, greedy=greedy, eos_id=eos_id,
                           banned_ids=banned_ids)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  greedy = bool(greedy) or temperature == 0
  rng = _check_causal_args(config, prompt_tokens, max_new_tokens, banned_ids, greedy, rng)
  seqs, scores = _beam_sample_causal(
      config, params, prompt_tokens, jnp.asarray(prompt_lengths, jnp.int32), rng,
      jnp.float32(1.0 if greedy else temperature), jnp.int32(top_k), jnp.float32(top_p),
      jnp.int32(eos_id), jnp.asarray(list(banned_ids), jnp.int32), jnp.float32(length_penalty),
      num_beams=int(num_beams), max_new_tokens=int(max_new_tokens), greedy=greedy,
      use_top_k=not greedy and top_k > 0, use_top_p=not greedy and top_p < 1.0)
  return (seqs, scores) if return_all else seqs[:, 0]
