"""Autoregressive generation for T5 with a key/value cache.

The encoder runs once; a `jax.lax.while_loop` then feeds one token per step
through the decoder's cached self-attention, sampling with temperature,
top-k and nucleus (top-p) filtering, or greedily. Shapes are static
(`max_length` and which filters are on are static jit arguments), so the
whole thing compiles once per (config, batch shape, settings).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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

  # The cache's shapes come from a full-length call; every entry (keys,
  # values, position index) starts at zero, so no real forward pass is needed.
  cache_shapes = jax.eval_shape(
      lambda: model.apply({"params": params}, encoded, encoder_input_tokens,
                          jnp.zeros((batch, max_length), jnp.int32), decode=True,
                          mutable=["cache"], method=T5Transformer.decode)[1]["cache"])
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)

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
