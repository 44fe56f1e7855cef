"""SeqPATE's test-set metrics (Tian et al., NeurIPS 2022, Sec. 6 and App. O).

* PPL: exp of the mean token NLL over every token after BOS (EOS included).
* BLEU-3 / BLEU-4: each test prefix (its first 4 words) completed greedily;
  the completion (text after the prefix) scored against the reference
  completion with sacrebleu's corpus BLEU at `max_ngram_order` 3 / 4
  (defaults otherwise: 13a, exp smoothing).
* Name leakage (AirDialogue; paper App. O's R_name): the fraction of test
  completions whose generated text contains, as whole words, the full name
  of a user of the private training set.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import sacrebleu

from dpjax.generation import decoding
from dpjax.models import gpt2


def complete(config: gpt2.GPT2Config, params, arrays: dict,
             tokenizer, *, batch_size: int = 64) -> list[str]:
  """Greedy completions of each row's prefix (`prefix_lengths`), decoded up
  to the first EOS by `tokenizer` (`experiment.Tokenizer`)."""
  lengths = arrays["prefix_lengths"]
  width = int(lengths.max())
  prompts = arrays["tokens"][:, :width]
  max_new = arrays["tokens"].shape[1] - int(lengths.min())
  pad = -len(prompts) % batch_size
  prompts = np.concatenate([prompts, np.repeat(prompts[-1:], pad, 0)])
  lengths = np.concatenate([lengths, np.repeat(lengths[-1:], pad)])
  out = np.concatenate([np.asarray(decoding.generate_causal(
      config, params, prompts[i:i + batch_size], lengths[i:i + batch_size],
      max_new_tokens=max_new, rng=None, greedy=True,
      eos_id=tokenizer.eos_id)) for i in range(0, len(prompts), batch_size)])
  texts = []
  for row in out[:len(out) - pad]:
    eos = np.flatnonzero(row == tokenizer.eos_id)
    texts.append(tokenizer.decode(row[:eos[0] if len(eos) else len(row)])
                 .strip())
  return texts


def bleu(hypotheses: Sequence[str], references: Sequence[str],
         order: int) -> float:
  """sacrebleu corpus BLEU (0-100) up to `order`-grams, one reference each."""
  return sacrebleu.BLEU(max_ngram_order=order).corpus_score(
      list(hypotheses), [list(references)]).score


def name_leakage(generated: Sequence[str], names: Sequence[str]) -> float:
  """Fraction of `generated` texts containing one of `names` (whole words,
  case-sensitive)."""
  if not names:
    raise ValueError("no names to look for.")
  pattern = re.compile(r"\b(?:" + "|".join(
      re.escape(n) for n in sorted(set(names), key=len, reverse=True))
      + r")\b")
  return float(np.mean([bool(pattern.search(t)) for t in generated]))


def evaluate(config: gpt2.GPT2Config, params, test: dict,
             tokenizer, names: Sequence[str] | None) -> dict:
  """PPL, BLEU-3/4 and (with `names`) name leakage on the test set."""
  generated = complete(config, params, test["arrays"], tokenizer)
  row = {"ppl": gpt2.perplexity(config, params, test["arrays"]["tokens"],
                                test["arrays"]["loss_weights"]),
         "bleu3": bleu(generated, test["references"], 3),
         "bleu4": bleu(generated, test["references"], 4)}
  if names:
    row["name_leakage"] = name_leakage(generated, names)
  row["samples"] = [{"prefix": p, "generated": g}
                    for p, g in zip(test["prefixes"][:5], generated[:5])]
  return row
