"""Autoregressive generation with a key/value cache: T5 and GPT-2.

`generate` (T5): the encoder runs once; a `jax.lax.while_loop` then feeds one
token per step through the decoder's cached self-attention. `generate_causal`
(GPT-2) feeds the prompt through the same kind of loop and then continues it.
Tokens are sampled with temperature, top-k and nucleus (top-p) filtering, or
greedily. Shapes are static (lengths and which filters are on are static jit
arguments), so each compiles once per (config, batch shape, settings).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from dpjax.models.gpt2 import GPT2, GPT2Config
from dpjax.models.t5 import T5Config, T5Transformer

Array = jax.Array


def _filter_sorted(logits: Array, keep_sorted_fn) -> Array:
  """Keeps the tokens whose rank passes `keep_sorted_fn`; the rest become -inf.

  `keep_sorted_fn` maps logits sorted in decreasing order (stable, so ties
  keep index order) to a boolean mask in that order.
  """
  order = jnp.argsort(-logits, axis=-1, stable=True)
  keep_sorted = keep_sorted_fn(jnp.take_along_axis(logits, order, axis=-1))
  keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), order, keep_sorted, axis=-1,
                            inplace=False)
  return jnp.where(keep, logits, -jnp.inf)


def top_k_filter(logits: Array, k: int | Array) -> Array:
  """Keeps exactly the `k` largest logits per row (ties: lowest index first);
  the rest become -inf. `k` may be traced (no recompilation per k).
  """
  return _filter_sorted(logits, lambda s: jnp.arange(s.shape[-1]) < k)


def top_p_filter(logits: Array, p: float | Array) -> Array:
  """Nucleus filter: keeps the smallest set of most likely tokens whose
  probabilities sum to at least `p` (always at least the argmax); the rest
  become -inf. `p` may be traced.
  """
  def keep(sorted_logits):
    probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
    # A token is kept iff the mass strictly before it has not yet reached p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return (mass_before < p).at[..., 0].set(True)

  return _filter_sorted(logits, keep)


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
  logits = logits.astype(jnp.float32) / temperature
  if use_top_k:
    logits = top_k_filter(logits, top_k)
  if use_top_p:
    logits = top_p_filter(logits, top_p)
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


@functools.partial(jax.jit, static_argnames=(
    "config", "max_new_tokens", "greedy", "use_top_k", "use_top_p"))
def _generate_causal(config, params, prompt_tokens, prompt_lengths, rng, temperature, top_k,
                     top_p, eos_id, banned_ids, *, max_new_tokens, greedy, use_top_k,
                     use_top_p):
  model = GPT2(config)
  batch, prompt_width = prompt_tokens.shape
  # A row with prompt length p feeds positions 0..p+max_new_tokens-2 (its last
  # token is never fed back), so the widest prompt bounds the cache.
  num_positions = prompt_width + max_new_tokens - 1
  lengths = jnp.clip(prompt_lengths, 1, prompt_width)

  def decode_step(cache, tokens):
    logits, state = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                decode=True, mutable=["cache"])
    return logits[:, 0], state["cache"]

  # Every cache entry (keys, values, index) starts at zero: only shapes needed.
  cache_shapes = jax.eval_shape(lambda: model.apply(
      {"params": params}, jnp.zeros((batch, num_positions), jnp.int32), decode=True,
      mutable=["cache"])[1]["cache"])
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)
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
    from_prompt = jax.lax.dynamic_index_in_dim(
        prompt_tokens, jnp.minimum(t + 1, prompt_width - 1), axis=1, keepdims=False)
    token = jnp.where(t + 1 < lengths, from_prompt, sampled)
    return t + 1, token, cache, rng, out, done

  init = (jnp.array(0, jnp.int32), prompt_tokens[:, 0], cache, rng,
          jnp.full((batch, max_new_tokens), eos_id, jnp.int32), jnp.zeros((batch,), bool))
  return jax.lax.while_loop(cond, body, init)[4]


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
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}.")
  if prompt_tokens.shape[1] + max_new_tokens - 1 > config.n_positions:
    raise ValueError(f"Prompt width {prompt_tokens.shape[1]} + max_new_tokens "
                     f"{max_new_tokens} - 1 exceeds n_positions {config.n_positions}.")
  if any(not 0 <= i < config.vocab_size for i in banned_ids):
    raise ValueError(f"banned_ids {list(banned_ids)} outside the vocabulary.")
  greedy = bool(greedy) or temperature == 0
  if rng is None:
    if not greedy:
      raise ValueError("Sampling needs an rng; pass greedy=True for argmax decoding.")
    rng = jax.random.PRNGKey(0)
  return _generate_causal(
      config, params, prompt_tokens, jnp.asarray(prompt_lengths, jnp.int32), rng,
      jnp.float32(1.0 if greedy else temperature), jnp.int32(top_k), jnp.float32(top_p),
      jnp.int32(eos_id), jnp.asarray(list(banned_ids), jnp.int32),
      max_new_tokens=int(max_new_tokens), greedy=greedy, use_top_k=not greedy and top_k > 0,
      use_top_p=not greedy and top_p < 1.0)
