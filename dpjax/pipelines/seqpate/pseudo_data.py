"""Pseudo-data: public prefixes completed by the pre-trained GPT-2 (paper
Sec. 4.1), the contexts on which teachers are queried and the student trains.

Layout (as for the private completions of `tasks.seqpate`): row r is
`[BOS] + prefix + completion`, right-padded with EOS to a fixed length L;
`loss_weights` are 1 on every generated position up to and including the
first EOS after the prefix (and on the prefix tokens after BOS, which are
targets too), 0 on BOS and padding.
"""
from __future__ import annotations

import jax
import numpy as np

from dpjax.generation import decoding
from dpjax.models import gpt2


def complete_prefixes(config: gpt2.GPT2Config, params, prefix_tokens: np.ndarray,
                      prefix_lengths: np.ndarray, *, length: int,
                      rng: jax.Array, eos_id: int, top_k: int = 0,
                      top_p: float = 1.0, temperature: float = 1.0,
                      batch_size: int = 64) -> dict[str, np.ndarray]:
  """Completes each prefix to `length` tokens with `decoding.generate_causal`.

  Args:
    config, params: the pre-trained (public) GPT-2.
    prefix_tokens: `[n, W]` right-padded prompts starting with BOS.
    prefix_lengths: `[n]` prompt lengths (BOS included), 1..W.
    length: L, the pseudo sentences' length (prefix included).
    rng: sampling key; batch b uses `fold_in(rng, b)`.
    eos_id: EOS (= BOS for GPT-2).
    top_k, top_p, temperature: sampling (`decoding.sample_logits`).
    batch_size: rows per `generate_causal` call (the last batch is padded,
      so it compiles once).

  Returns:
    {"tokens": [n, L] int32, "loss_weights": [n, L] float32}.
  """
  prefix_tokens = np.asarray(prefix_tokens, np.int32)
  lengths = np.asarray(prefix_lengths, np.int32)
  n, width = prefix_tokens.shape
  if not ((lengths >= 1) & (lengths <= width)).all() or lengths.max() >= length:
    raise ValueError(f"prefix lengths must be in [1, {width}] and below "
                     f"length {length}.")
  max_new = int(length - lengths.min())
  pad = -n % batch_size
  prompts = np.concatenate([prefix_tokens, np.repeat(prefix_tokens[-1:], pad, 0)])
  prompt_lengths = np.concatenate([lengths, np.repeat(lengths[-1:], pad)])
  generated = np.concatenate([np.asarray(decoding.generate_causal(
      config, params, prompts[i:i + batch_size],
      prompt_lengths[i:i + batch_size], max_new_tokens=max_new,
      rng=jax.random.fold_in(rng, i // batch_size), temperature=temperature,
      top_k=top_k, top_p=top_p, eos_id=eos_id))
      for i in range(0, n + pad, batch_size)])[:n]
  # Prompt columns, then the row's own generated tokens.
  cols = np.arange(length)[None, :]
  in_prompt = cols < lengths[:, None]
  from_prompt = np.take_along_axis(prefix_tokens, np.minimum(cols, width - 1)
                                   .repeat(n, 0), 1)
  from_generated = np.take_along_axis(
      generated, np.clip(cols - lengths[:, None], 0, max_new - 1), 1)
  tokens = np.where(in_prompt, from_prompt, from_generated).astype(np.int32)
  # Targets: positions 1 .. the first EOS after the prompt (or the end).
  is_eos = (tokens == eos_id) & ~in_prompt
  first_eos = np.where(is_eos.any(1), is_eos.argmax(1), length - 1)
  loss_weights = ((cols >= 1) & (cols <= first_eos[:, None])).astype(
      np.float32)
  return {"tokens": tokens, "loss_weights": loss_weights}
