"""PPLM-steered sampling from a `gpt2_disc` model, and the paper's
generation baselines (an ICLR 2023 submission, OpenReview LUql3ZOFwFD, Sec.
5.1-5.2).

Steering (`pplm_generate_causal`). At each position t, after feeding the
token there through the KV cache, let h be its final hidden state (the
GPT-2's output after the final norm, which gives the next-token logits
`h @ wte.T`), S the sum of the hidden states of positions 0..t-1, and a the
row's target class. As the paper describes (Sec. 5.2: "shift the hidden
state h_i ... compute the new LM head distribution from the updated latent
space"), h is shifted by Δ, starting at 0, with `num_iterations` normalized
gradient steps

    Δ <- Δ - step_size * g / (|g| + 1e-10) ** gamma,   g = ∇_Δ L(Δ) per row,
    L(Δ) = -log p(a | (S + h + Δ) / (t + 1))
           + kl_scale * KL(softmax((h + Δ) wte.T) || softmax(h wte.T)),

the discriminator reading the mean hidden state of the text so far as in
training (`gpt2_disc`), the KL keeping the modified next-token distribution
near the unmodified one (PPLM's fluency term; gamma and the normalization
are PPLM's). The next token is then sampled from the geometric-mean fusion
p ∝ p_mod^gm_scale · p_unmod^(1 - gm_scale) (PPLM's `gm_scale`), after
temperature, top-k and nucleus (top-p) filtering as in `decoding`. The
running sum S takes the unshifted h: the shift only chooses the next token.

Unlike the original PPLM code, which perturbs the key/value history and
looks one token ahead through the model, this shifts the one hidden state
the paper names; each iteration costs two `[b, d] x [d, vocab]` products,
no transformer pass.

With `step_size = 0`, Δ stays exactly 0, the fused scores are exactly the
logits (they are computed as `logits + gm_scale * (log p_mod - log
p_unmod)`), and the random keys are split as in `decoding.generate_causal`,
so the tokens are those of `generate_causal` with the same arguments and
key, bit for bit.

Baselines: plain conditional sampling is `decoding.generate_causal` on the
`BOS label SEP` prompts (`tasks.textcls.prompt_tokens`); `filter_by_classifier`
keeps the samples a classifier gives p(a | x) > threshold (Baseline 1, with
any classifier, e.g. `dpjax.pipelines.text_classifier`); `discriminator_probs`
scores generations with a discriminator head (e.g. Baseline 2's post-hoc
head, `gpt2_disc` with `head_only`).

Formal guarantees: post-processing. Nothing here reads private data: the
outputs are functions of the (DP-trained) params, the prompts and the keys,
so they carry the params' (ε, δ).

No TensorFlow: jax and numpy only.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.generation import decoding
from dpjax.models import gpt2, gpt2_disc

Array = jax.Array


def _stepper(config: gpt2.GPT2Config, params, batch: int, num_positions: int):
  """Like `decoding._causal_stepper` but `step` returns the final hidden
  states `[batch, d_model]` instead of the logits."""
  model = gpt2.GPT2(config)

  def step(cache, tokens):
    hidden, state = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                decode=True, return_hidden=True, mutable=["cache"])
    return hidden[:, 0], state["cache"]

  cache_shapes = jax.eval_shape(lambda: model.apply(
      {"params": params}, jnp.zeros((batch, num_positions), jnp.int32), decode=True,
      mutable=["cache"])[1]["cache"])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes), step


def _shift(config: gpt2_disc.GPT2DiscConfig, params, wte, hidden, prefix_sum, count, targets,
           step_size, num_iterations, kl_scale, gamma):
  """Δ `[b, d]` after `num_iterations` normalized gradient steps (see the
  module docstring)."""
  unmodified = jax.nn.log_softmax(jnp.dot(hidden, wte.T), axis=-1)

  def loss(delta):
    log_p = jax.nn.log_softmax(jnp.dot(hidden + delta, wte.T), axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - unmodified), axis=-1)
    mean = (prefix_sum + hidden + delta) / count
    disc = -jnp.sum(jax.nn.log_softmax(gpt2_disc.head_logits(config, params, mean)) * targets,
                    axis=-1)
    return jnp.sum(disc + kl_scale * kl)  # rows are independent: per-row gradients

  def iteration(_, delta):
    g = jax.grad(loss)(delta)
    norm = jnp.linalg.norm(g, axis=-1, keepdims=True)
    return delta - step_size * g / (norm + 1e-10) ** gamma

  return jax.lax.fori_loop(0, num_iterations, iteration, jnp.zeros_like(hidden))


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "use_top_k",
                                             "use_top_p"))
def _pplm_generate_causal(config, params, prompt_tokens, prompt_lengths, labels, rng,
                          step_size, num_iterations, kl_scale, gm_scale, gamma, temperature,
                          top_k, top_p, eos_id, banned_ids, *, max_new_tokens, use_top_k,
                          use_top_p):
  lm_params = gpt2_disc.lm_params(params)
  wte = lm_params["token_embedder"]["embedding"]
  batch, prompt_width = prompt_tokens.shape
  num_positions = prompt_width + max_new_tokens - 1  # as in decoding._generate_causal
  lengths = jnp.clip(prompt_lengths, 1, prompt_width)
  cache, decode_step = _stepper(config.lm, lm_params, batch, num_positions)
  columns = jnp.arange(max_new_tokens)
  targets = jax.nn.one_hot(labels, config.num_classes, dtype=jnp.float32)

  def cond(state):
    t, _, _, _, _, done, _ = state
    return (t < num_positions) & ~jnp.all(done)

  def body(state):
    # Position t holds `token`; its (steered) logits predict position t + 1.
    t, token, cache, rng, out, done, prefix_sum = state
    hidden, cache = decode_step(cache, token)
    logits = jnp.dot(hidden.astype(jnp.float32), wte.T)  # GPT2's tied output layer
    delta = _shift(config, params, wte, hidden, prefix_sum, (t + 1).astype(jnp.float32),
                   targets, step_size, num_iterations, kl_scale, gamma)
    modified = jnp.dot(hidden + delta, wte.T)
    scores = logits + gm_scale * (jax.nn.log_softmax(modified, axis=-1)
                                  - jax.nn.log_softmax(logits, axis=-1))
    if banned_ids.shape[0]:
      scores = scores.at[:, banned_ids].set(-jnp.inf)
    rng, sample_rng = jax.random.split(rng)
    sampled = decoding.sample_logits(scores, sample_rng, temperature=temperature, top_k=top_k,
                                     top_p=top_p, use_top_k=use_top_k, use_top_p=use_top_p)
    column = t + 1 - lengths  # output index of position t + 1; < 0 inside the prompt
    write = (column >= 0) & ~done
    out = jnp.where(write[:, None] & (columns == column[:, None]), sampled[:, None], out)
    done = done | (write & ((sampled == eos_id) | (column == max_new_tokens - 1)))
    token = jnp.where(t + 1 < lengths, decoding._prompt_token(prompt_tokens, t + 1), sampled)
    return t + 1, token, cache, rng, out, done, prefix_sum + hidden

  init = (jnp.array(0, jnp.int32), prompt_tokens[:, 0], cache, rng,
          jnp.full((batch, max_new_tokens), eos_id, jnp.int32), jnp.zeros((batch,), bool),
          jnp.zeros((batch, config.lm.d_model), jnp.float32))
  return jax.lax.while_loop(cond, body, init)[4]


def pplm_generate_causal(config: gpt2_disc.GPT2DiscConfig, params, prompt_tokens: Array,
                         prompt_lengths: Array, labels: Array, *, max_new_tokens: int,
                         rng: Array, step_size: float, num_iterations: int = 3,
                         kl_scale: float = 0.01, gm_scale: float = 0.9, gamma: float = 1.5,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         eos_id: int = 50256, banned_ids: Sequence[int] = ()) -> Array:
  """Continues each prompt with `[b, max_new_tokens]` int32 tokens, steered
  towards class `labels[r]` (0-based) of the discriminator head.

  Prompts, `eos_id`, `banned_ids`, the output layout and the limits are as
  in `decoding.generate_causal`; sampling is temperature, top-k and top-p
  (nucleus) on the steered scores. The steering arguments (defaults: PPLM's)
  are in the module docstring; `step_size = 0` (or `num_iterations = 0`)
  is `generate_causal` exactly. All scalars are runtime arguments: compiles
  once per (config, prompt shape, max_new_tokens, number of banned ids,
  whether top-k and whether top-p are on).
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  labels = jnp.asarray(labels, jnp.int32)
  if labels.shape != prompt_tokens.shape[:1]:
    raise ValueError(f"need one label per prompt row, got {labels.shape} for "
                     f"{prompt_tokens.shape[0]} rows")
  if labels.size and not 0 <= int(labels.min()) <= int(labels.max()) < config.num_classes:
    raise ValueError(f"labels must be in 0..{config.num_classes - 1}")
  if num_iterations < 0 or step_size < 0 or temperature <= 0:
    raise ValueError(f"need num_iterations >= 0, step_size >= 0 and temperature > 0; got "
                     f"{num_iterations}, {step_size}, {temperature}")
  rng = decoding._check_causal_args(config.lm, prompt_tokens, max_new_tokens, banned_ids,
                                    False, rng)
  return _pplm_generate_causal(
      config, params, prompt_tokens, jnp.asarray(prompt_lengths, jnp.int32), labels, rng,
      jnp.float32(step_size), jnp.int32(num_iterations), jnp.float32(kl_scale),
      jnp.float32(gm_scale), jnp.float32(gamma), jnp.float32(temperature), jnp.int32(top_k),
      jnp.float32(top_p), jnp.int32(eos_id), jnp.asarray(list(banned_ids), jnp.int32),
      max_new_tokens=int(max_new_tokens), use_top_k=top_k > 0, use_top_p=top_p < 1.0)


# ----------------------------------------------------------------------------
# Baselines: scoring and filtering generations.
# ----------------------------------------------------------------------------


def generated_rows(prompt_tokens: np.ndarray, prompt_lengths: np.ndarray,
                   generated: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
  """`{"tokens", "attention_mask"}` `[b, P + N]`: each prompt followed by its
  generation up to and including its first EOS (the layout of a training
  row), right-padded with `eos_id`."""
  prompt_tokens, generated = np.asarray(prompt_tokens), np.asarray(generated)
  b, width = prompt_tokens.shape
  n = generated.shape[1]
  lengths = np.clip(np.asarray(prompt_lengths), 1, width)
  is_eos = generated == eos_id
  kept = np.where(is_eos.any(1), is_eos.argmax(1) + 1, n)  # generated tokens kept
  pos = np.arange(width + n)[None]
  from_prompt = np.take_along_axis(prompt_tokens, np.minimum(pos, width - 1).repeat(b, 0), 1)
  from_generated = np.take_along_axis(generated, np.clip(pos - lengths[:, None], 0, n - 1), 1)
  real = pos < (lengths + kept)[:, None]
  tokens = np.where(pos < lengths[:, None], from_prompt, np.where(real, from_generated, eos_id))
  return {"tokens": tokens.astype(np.int32), "attention_mask": real.astype(np.int32)}


def discriminator_probs(config: gpt2_disc.GPT2DiscConfig, params, rows: dict[str, np.ndarray],
                        rng: Array) -> np.ndarray:
  """`[b, C]` discriminator probabilities of `generated_rows` (label slot
  randomized as in training; `gpt2_disc.make_predict`)."""
  return np.asarray(_predict(config)(params, rows, rng))


@functools.lru_cache(maxsize=None)
def _predict(config: gpt2_disc.GPT2DiscConfig):
  return jax.jit(gpt2_disc.make_predict(config))


def filter_by_classifier(probs: np.ndarray, labels: np.ndarray, threshold: float = 0.5
                         ) -> np.ndarray:
  """`[n]` bool: keep sample i iff `probs[i, labels[i]] > threshold` (the
  paper's Baseline 1 filter, p(a | x) > 0.5)."""
  probs, labels = np.asarray(probs), np.asarray(labels)
  return np.take_along_axis(probs, labels[:, None], axis=1)[:, 0] > threshold
