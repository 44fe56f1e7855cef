"""The steps of the semantic-parse experiments: train, generate, parse, score.

Each step works on run directories written by `dpjax.train` (so every model
carries its privacy ledger) and is skipped when its output already exists,
so an interrupted experiment resumes where it stopped:

* training: `harness.train_run` (one `configurables.train()` with gin files +
  bindings).
* `generate_texts`: GPT-2 continuations of prompts (the task's BPE), by
  multinomial beam search (`decoding.beam_sample_causal`; 1 beam = sampling).
* `parse_utterances`: a T5 parser's greedy parses (linearized Lispress).
* `score`: the paper's language and parse metrics of synthetic utterances
  against human ones.

Generation and parsing are post-processing of trained models: they spend no
privacy budget. This module imports the data layer (seqio), so it is a
driver, not part of the DP core.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from dpjax.training import checkpoints
from dpjax.generation import decoding, inference
from dpjax.eval import mauve
from dpjax.pipelines.semparse import metrics
from dpjax.data.text import lispress
import tasks

_LENGTH_BUCKET = 16  # prompt lengths are rounded up to limit recompilation


def _task_vocabulary(meta: checkpoints.RunMeta):
  # Lazy: seqio imports TensorFlow, only needed to decode.
  import seqio
  tasks.register_tasks(tokenizer_files=meta.tokenizer_files)
  return seqio.get_mixture_or_task(
      meta.mixture_or_task_name).output_features["targets"].vocabulary


def _batches(rows: np.ndarray, batch_size: int):
  """Fixed-size batches (the last padded by repeating row 0) and real sizes."""
  for s in range(0, len(rows), batch_size):
    chunk = rows[s:s + batch_size]
    pad = batch_size - len(chunk)
    yield np.concatenate([chunk, np.repeat(rows[:1], pad, 0)]), len(chunk)


def _right_padded(rows: Sequence[list[int]], pad_id: int, max_width: int, *,
                  keep_end: bool) -> tuple[np.ndarray, np.ndarray]:
  """`[n, width]` int32 rows padded with `pad_id`, and their lengths; width is
  the longest row rounded up to `_LENGTH_BUCKET` (fewer compilations), at
  most `max_width`; longer rows keep their end or their start."""
  width = min(max_width,
              -(-max(len(r) for r in rows) // _LENGTH_BUCKET) * _LENGTH_BUCKET)
  tokens = np.full((len(rows), width), pad_id, np.int32)
  lengths = np.zeros((len(rows),), np.int32)
  for i, r in enumerate(rows):
    r = r[-width:] if keep_end else r[:width]
    tokens[i, :len(r)], lengths[i] = r, len(r)
  return tokens, lengths


def _until(ids, stop_id: int) -> list[int]:
  ids = [int(t) for t in ids]
  return ids[:ids.index(stop_id)] if stop_id in ids else ids


def generate_texts(model_dir: str, prompts: Sequence[str], *, num_beams: int,
                   max_new_tokens: int, seed: int, top_k: int = 50,
                   top_p: float = 1.0, temperature: float = 1.0,
                   batch_size: int = 64) -> list[str]:
  """One continuation per prompt from the GPT-2 run in `model_dir`.

  Each prompt is encoded with the run's task vocabulary after a BOS (GPT-2's
  `<|endoftext|>`, as in training), so `""` samples from the unconditional
  LM. Text after the first EOS is dropped; whitespace is normalised.
  `top_k=50` is Hugging Face's default, which the paper's decoding used.
  """
  config, params, meta = inference.load_trained(model_dir)
  vocab = _task_vocabulary(meta)
  eos = vocab.eos_id
  # An over-long prompt keeps its end, next to the output.
  tokens, lengths = _right_padded(
      [[eos] + list(vocab.encode(p)) for p in prompts], eos,
      config.n_positions - max_new_tokens + 1, keep_end=True)
  run = lambda p, x, n, rng: decoding.beam_sample_causal(  # jitted inside
      config, p, x, n, num_beams=num_beams, max_new_tokens=max_new_tokens,
      rng=rng, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos)
  rows = np.concatenate([tokens, lengths[:, None]], 1)
  out = []
  for b, (batch, real) in enumerate(_batches(rows, batch_size)):
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), b)
    got = np.asarray(run(params, batch[:, :-1], batch[:, -1], rng))[:real]
    out += [" ".join(vocab.decode(_until(g, eos)).split()) for g in got]
  return out


def parse_utterances(parser_dir: str, utterances: Sequence[str], *,
                     batch_size: int = 128) -> list[str]:
  """Greedy parses (linearized Lispress text, maybe malformed) by a T5 run."""
  config, params, meta = inference.load_trained(parser_dir)
  vocab = _task_vocabulary(meta)
  lengths = meta.task_feature_lengths
  eos = vocab.eos_id
  tokens = np.zeros((len(utterances), lengths["inputs"]), np.int32)
  for i, u in enumerate(utterances):
    ids = list(vocab.encode(u))[:lengths["inputs"] - 1] + [eos]
    tokens[i, :len(ids)] = ids
  run = lambda p, x: decoding.generate(  # jitted inside
      config, p, x, max_length=lengths["targets"], rng=None, greedy=True,
      eos_id=eos)
  out = []
  for batch, real in _batches(tokens, batch_size):
    got = np.asarray(run(params, batch))[:real]
    out += [vocab.decode(_until(g, eos)) for g in got]
  return out


def function_types_or_none(program: str) -> list[str] | None:
  """The program's function types, or None if it is not valid Lispress."""
  try:
    return lispress.function_types(program)
  except lispress.LispressError:
    return None


def lm_features(model_dir: str, texts: Sequence[str]) -> np.ndarray:
  """`[len(texts), d]` MAUVE features: the last hidden state of each text
  (after BOS, no EOS) under the GPT-2 run in `model_dir`."""
  config, params, meta = inference.load_trained(model_dir)
  vocab = _task_vocabulary(meta)
  tokens, lengths = _right_padded(
      [[vocab.eos_id] + list(vocab.encode(t)) for t in texts], vocab.eos_id,
      config.n_positions, keep_end=False)
  return np.asarray(metrics.text_features(config, params, tokens, lengths))


def score(synthetic: Sequence[str], synthetic_types: Sequence[list[str] | None],
          human: Sequence[str], human_types: Sequence[list[str]], *,
          synthetic_features: np.ndarray, human_features: np.ndarray,
          top_k: Sequence[int] = (10, 25, 50, 100), mauve_seed: int = 0
          ) -> dict:
  """The paper's Table 1 metrics (and Table 6's top-k coverage).

  Parse metrics use the function types of each synthetic utterance's parse
  by the high-resource parser; an unparsable parse contributes no types (and
  is counted in `invalid_parse_fraction`).
  """
  gen_types = [t or [] for t in synthetic_types]
  row = {
      "num_synthetic": len(synthetic),
      "word_overlap": metrics.word_type_overlap(synthetic, human),
      "mauve": mauve.mauve(human_features, synthetic_features,
                             seed=mauve_seed),
      "invalid_parse_fraction": float(np.mean(
          [t is None for t in synthetic_types])) if synthetic_types else 0.0,
  }
  if any(gen_types):
    row["chi2_distance"] = metrics.chi_square_distance(gen_types, human_types)
    row["function_overlap"] = metrics.function_type_overlap(gen_types,
                                                            human_types)
    for k in top_k:
      row[f"top{k}_coverage"] = metrics.top_k_function_coverage(
          gen_types, human_types, k)
  else:  # no valid parse at all: disjoint distributions, nothing covered
    row.update(chi2_distance=1.0, function_overlap=0.0,
               **{f"top{k}_coverage": 0.0 for k in top_k})
  return row


def parser_scores(predicted: Sequence[str], gold: Sequence[str],
                  focus: Sequence[str] = ()) -> dict:
  """Exact match and API (function-type) precision/recall of parses.

  Exact match compares programs after parsing and re-rendering (so spacing
  never matters; an unparsable prediction is wrong). API precision/recall
  are micro-averaged over examples: Σ|P∩G| / Σ|P| and Σ|P∩G| / Σ|G| for the
  predicted and gold function-type sets. With `focus` (fnmatch patterns of
  function names, e.g. the paper's removed "Weather*"), the same numbers
  are also given over the examples whose gold program calls a focus
  function ("focus_*"), with precision/recall counting focus types only.
  """
  import fnmatch

  def canonical(p):
    try:
      return lispress.render(p)
    except lispress.LispressError:
      return None

  def in_focus(name):
    return any(fnmatch.fnmatchcase(name, pat) for pat in focus)

  def counts(pairs, keep):
    hit = pred_n = gold_n = exact = 0
    for p, g in pairs:
      pt = set(function_types_or_none(p) or []) if p is not None else set()
      gt = set(lispress.function_types(g))
      pt, gt = {t for t in pt if keep(t)}, {t for t in gt if keep(t)}
      hit, pred_n, gold_n = hit + len(pt & gt), pred_n + len(pt), gold_n + len(gt)
      exact += canonical(p) is not None and canonical(p) == canonical(g)
    return {"examples": len(pairs),
            "exact_match": exact / len(pairs) if pairs else float("nan"),
            "api_precision": hit / pred_n if pred_n else 0.0,
            "api_recall": hit / gold_n if gold_n else float("nan")}

  pairs = list(zip(predicted, gold))
  out = counts(pairs, lambda t: True)
  if focus:
    focused = [(p, g) for p, g in pairs
               if any(in_focus(t) for t in lispress.function_types(g))]
    out.update({f"focus_{k}": v for k, v in counts(focused, in_focus).items()})
  return out
