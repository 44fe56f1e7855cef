"""Automatic sizing (dpjax.training.sizing): the choice against a brute-force search
over every candidate, the byte sizes, the nested-config remat, the record."""
from __future__ import annotations

import itertools
import types

import jax
import pytest

from dpjax import errors
from dpjax.training import partitioning, sizing
from dpjax.models import gpt2, gpt2_disc, t5


def _brute_force(peak, sizes, max_batch, variants, limit):
  """Every (m, variant) that fits, ordered by (calls, variant order)."""
  fitting = [(-(-max_batch // m), variants.index(v), m, v)
             for m, v in itertools.product(sizes, variants)
             if peak(m, v) <= limit]
  return min(fitting) if fitting else None


def _variants(*remats):
  return [sizing.Variant(r) for r in remats]


def _affine_peak(state, per_example, remat_saving):
  """A step whose activations grow with m; layer remat keeps a fraction."""
  return lambda m, v: state + m * per_example * (
      remat_saving if v.remat == "layer" else 1.0)


@pytest.mark.parametrize("limit", [150, 1_000, 3_000, 9_000, 40_000, 10**6])
@pytest.mark.parametrize("remats", [("none",), ("layer",), ("none", "layer")])
def test_choice_is_the_brute_force_optimum(limit, remats):
  peak = _affine_peak(state=100, per_example=70, remat_saving=0.3)
  sizes = sizing.microbatch_candidates(300, multiple=2)
  variants = _variants(*remats)
  got = sizing.choose(peak, sizes=sizes, max_batch=300, variants=variants,
                      limit_bytes=limit, memory_source="test")
  best = _brute_force(peak, sizes, 300, variants, limit)
  if best is None:
    assert not got.fits and got.microbatch_size == sizes[-1]
    return
  calls, _, m, variant = best
  assert got.fits and (got.microbatch_size, got.remat) == (m, variant.remat)
  assert got.accumulation_steps == calls
  assert got.peak_bytes == peak(m, variant) <= limit


def test_remat_is_taken_only_when_it_saves_calls():
  """At a limit where the whole batch fits only with remat, remat wins (1
  call against 2); where remat would not halve the calls, no remat."""
  peak = _affine_peak(state=0, per_example=10, remat_saving=0.6)
  sizes = sizing.microbatch_candidates(64, multiple=1)
  pick = lambda limit: sizing.choose(
      peak, sizes=sizes, max_batch=64, variants=_variants("none", "layer"),
      limit_bytes=limit, memory_source="test")
  assert (pick(640).microbatch_size, pick(640).remat) == (64, "none")
  assert (pick(400).microbatch_size, pick(400).remat) == (64, "layer")
  assert (pick(150).microbatch_size, pick(150).remat) == (16, "layer")
  # 90 fits 8 examples either way (remat: 16 would need 96): no remat.
  assert (pick(90).microbatch_size, pick(90).remat) == (8, "none")


def test_bisection_compiles_logarithmically_many_candidates():
  calls = []

  def peak(m, r):
    calls.append((m, r))
    return m

  sizes = sizing.microbatch_candidates(1024, multiple=1)
  choice = sizing.choose(peak, sizes=sizes, max_batch=1024,
                         variants=_variants("none"), limit_bytes=100,
                         memory_source="test")
  assert choice.microbatch_size == 64 and len(sizes) == 11
  assert len(calls) == len(choice.tried) <= 5  # the whole batch, then 4


@pytest.mark.parametrize("limit", [60, 72, 100, 500])
def test_an_affine_peak_takes_at_most_three_compiles(limit):
  """The paper's XL shape: the whole batch (1085) far over the limit, the
  state (`floor_bytes`) under it: the line finds the size at once."""
  calls = []

  def peak(m, r):
    calls.append((m, r))
    return 42 + 7.5 * m

  sizes = sizing.microbatch_candidates(1085, multiple=1)
  choice = sizing.choose(peak, sizes=sizes, max_batch=1085, variants=_variants("none"),
                         limit_bytes=limit, memory_source="test",
                         floor_bytes=42)
  assert len(calls) <= 3
  best = _brute_force(peak, sizes, 1085, _variants("none"), limit)
  assert (choice.microbatch_size, sizing.Variant("none")) == best[2:]


@pytest.mark.parametrize("limit", [150, 1_000, 5_000, 20_000, 80_000])
@pytest.mark.parametrize("floor", [0, 100, 10_000])
def test_a_peak_far_from_affine_still_gets_the_optimum(limit, floor):
  """A convex peak (and a misleading floor) makes the line guess wrong; the
  bisection that takes over still finds the brute-force optimum, in a
  logarithmic number of compiles."""
  calls = []

  def peak(m, r):
    calls.append((m, r))
    return 100 + m * m

  sizes = sizing.microbatch_candidates(1024, multiple=1)
  choice = sizing.choose(peak, sizes=sizes, max_batch=1024, variants=_variants("none"),
                         limit_bytes=limit, memory_source="test",
                         floor_bytes=floor)
  assert len(calls) <= 2 * 4 + 1  # log2(11 sizes) ~ 3.5
  best = _brute_force(peak, sizes, 1024, _variants("none"), limit)
  assert (choice.microbatch_size, sizing.Variant("none")) == best[2:]


def test_ample_memory_costs_one_compile():
  calls = []
  sizing.choose(lambda m, r: calls.append((m, r)) or m,
                sizes=sizing.microbatch_candidates(1024, multiple=1),
                max_batch=1024, variants=_variants("none", "layer"),
                limit_bytes=2048,
                memory_source="test")
  assert calls == [(1024, sizing.Variant("none"))]


def test_book_keeping_is_a_variant_under_remat_only_where_left_to_auto():
  V = sizing.Variant
  assert sizing.variants("auto", "auto", ghost=True) == [
      V("none"), V("layer", "book_keeping"), V("layer")]
  assert sizing.variants("layer", "auto", ghost=True) == [
      V("layer", "book_keeping"), V("layer")]
  assert sizing.variants("auto", "auto", ghost=False) == [V("none"),
                                                          V("layer")]
  assert sizing.variants("auto", "second_pass", ghost=True) == [
      V("none", "second_pass"), V("layer", "second_pass")]
  assert sizing.variants(None, "auto", ghost=True) == [V(None)]


# Three layouts' memory per example (no remat, remat + book-keeping, remat +
# second pass) and time per example; a call costs 40 whatever its size.
_SAVING = {sizing.Variant("none"): 1.0,
           sizing.Variant("layer", "book_keeping"): 0.6,
           sizing.Variant("layer"): 0.3}
_RATE = {sizing.Variant("none"): 1.0,
         sizing.Variant("layer", "book_keeping"): 1.1,
         sizing.Variant("layer"): 1.6}


def _step_seconds(max_batch):
  return lambda m, v: -(-max_batch // m) * (40 + m * _RATE[v])


@pytest.mark.parametrize("limit", [150, 1_000, 3_000, 9_000, 16_000, 40_000])
def test_with_estimates_the_least_estimated_time_wins(limit):
  """With a time estimate, the choice is brute force's least time over
  every candidate that fits (time falls with the calls, so each variant's
  largest fitting microbatch is its best), and only those are costed."""
  peak = lambda m, v: 100 + m * 70 * _SAVING[v]
  sizes = sizing.microbatch_candidates(300, multiple=2)
  variants = list(_SAVING)
  seconds = _step_seconds(300)
  got = sizing.choose(peak, sizes=sizes, max_batch=300, variants=variants,
                      limit_bytes=limit, memory_source="test",
                      seconds=seconds)
  fitting = [(seconds(m, v), variants.index(v), m, v)
             for m, v in itertools.product(sizes, variants)
             if peak(m, v) <= limit]
  _, _, m, v = min(fitting)
  assert got.fits and (got.microbatch_size, got.remat,
                       got.ghost_summation) == (m, *v)
  largest = {(w, max(n for n in sizes if peak(n, w) <= limit))
             for w in variants if any(peak(n, w) <= limit for n in sizes)}
  costed = {(sizing.Variant(t["remat"], t["ghost_summation"]),
             t["microbatch_size"]) for t in got.tried if "seconds" in t}
  if len(largest) > 1:  # a choice to make: each variant's best costed
    assert got.seconds == pytest.approx(seconds(m, v)) and costed == largest
  else:
    assert got.seconds is None and not costed


def test_without_every_estimate_the_fewest_calls_win():
  """A variant the compiler gives no estimate for leaves the choice to
  calls, then variant order; without `seconds` the later variants are
  compiled only where they could take fewer calls."""
  peak = lambda m, v: m * 10 * _SAVING[v]
  sizes = sizing.microbatch_candidates(64, multiple=1)
  variants = list(_SAVING)
  no_remat_time = lambda m, v: None if v.remat == "layer" else 1.0
  for seconds in (None, no_remat_time):
    got = sizing.choose(peak, sizes=sizes, max_batch=64, variants=variants,
                        limit_bytes=300, memory_source="test",
                        seconds=seconds)
    # 64 fits only by the second pass (192); book-keeping takes 32 (192),
    # no remat 16 (160).
    assert (got.microbatch_size, got.remat, got.ghost_summation) == (
        64, "layer", "auto")
    assert got.seconds is None


@pytest.mark.parametrize("max_batch,multiple", [(1, 1), (292, 1), (300, 8),
                                                (1024, 1), (7, 4)])
def test_candidates_cover_the_batch_in_doubling_calls(max_batch, multiple):
  sizes = sizing.microbatch_candidates(max_batch, multiple)
  assert sizes == sorted(set(sizes), reverse=True)
  assert all(m % multiple == 0 for m in sizes)
  assert sizes[0] >= max_batch and sizes[-1] == multiple
  for m in sizes:  # no size is needlessly big for its number of calls
    calls = -(-max_batch // m)
    assert m - multiple < -(-max_batch // calls) <= m


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("16 GB", 16 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5gib", int(1.5 * 2**30)), (12e9, 12 * 10**9), (1000, 1000),
    ("2e9", 2 * 10**9)])
def test_parse_bytes(text, expected):
  assert sizing.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "-3GB", "80 furlongs", 0, -1,
                                 True, None, "1.2.3GB"])
def test_parse_bytes_refuses_nonsense(bad):
  with pytest.raises(errors.UsageError, match="train.device_memory"):
    sizing.parse_bytes(bad)


def test_device_memory_setting_wins_and_otherwise_is_positive():
  assert sizing.device_memory("1GiB") == (2**30, "train.device_memory")
  memory, source = sizing.device_memory(None)
  assert memory > 0 and source in ("backend bytes_limit", "host RAM")


def test_auto_remat_is_found_and_resolved_in_nested_configs():
  lm = gpt2.GPT2Config(vocab_size=11, n_positions=8, d_model=8, num_layers=1,
                       num_heads=2, remat="auto")
  disc = gpt2_disc.GPT2DiscConfig(lm=lm, label_token_ids=(3, 4))
  assert sizing.model_remat(disc) == "auto"
  resolved = sizing.with_remat(disc, "layer")
  assert resolved.lm.remat == "layer" and sizing.model_remat(resolved) == "layer"
  fixed = t5.T5Config(remat="none")
  assert sizing.with_remat(fixed, "layer") is fixed  # only 'auto' is resolved
  with pytest.raises(ValueError, match="build the model"):
    t5.remat_layer(t5.EncoderLayer, "auto", (2,))


def test_the_record_is_reused_only_for_the_same_fingerprint(tmp_path):
  choice = sizing.Choice(microbatch_size=8, remat="layer",
                         accumulation_steps=4, peak_bytes=123,
                         limit_bytes=456, memory_source="test",
                         tried=({"microbatch_size": 8, "remat": "layer",
                                 "peak_bytes": 123},))
  mesh = partitioning.make_mesh()
  key = sizing.fingerprint(mesh, model="a", max_batch=32)
  sizing.save(str(tmp_path), key, choice)
  assert sizing.load(str(tmp_path), key) == choice
  assert sizing.load(str(tmp_path), sizing.fingerprint(
      mesh, model="b", max_batch=32)) is None
  (tmp_path / sizing.FILENAME).write_text("{not json")
  assert sizing.load(str(tmp_path), key) is None


def test_a_compilers_refusal_is_a_peak_of_the_state_and_its_temporaries():
  """A TPU compiler refuses a program over its memory: over its HBM it names
  the temporaries it needs, and the search takes the resident state plus
  those as the peak (a lower bound); over a fusion's on-chip memory it names
  no figure, and the candidate has no peak. Any other error is not a size."""
  hbm = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
         "required for HLO temporaries (17.27G) exceeds available HBM (15.75G).")
  vmem = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
          "memory in memory space vmem. Used 16.36M of 16.00M vmem.\n"
          "  1. Size: 1.0K ...")

  def raising(message):
    def compiled_peak():
      raise jax.errors.JaxRuntimeError(message)
    return compiled_peak

  floor = 3 * 2**30
  assert sizing.peak_or_refusal(lambda: 5, floor) == (5, None)
  peak, refused = sizing.peak_or_refusal(raising(hbm), floor)
  assert peak == floor + int(17.27 * 2**30)
  assert refused.temporaries == int(17.27 * 2**30)
  peak, refused = sizing.peak_or_refusal(raising(vmem), floor)
  assert peak is None and refused.temporaries is None
  assert refused.message == ("XLA:TPU compile permanent error. Ran out of "
                             "memory in memory space vmem. Used 16.36M of "
                             "16.00M vmem.")
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    sizing.peak_or_refusal(raising("INTERNAL: something else"), floor)


@pytest.mark.parametrize("limit", [1_000, 3_000, 9_000])
@pytest.mark.parametrize("refused_above", [16, 40, 150])
def test_candidates_refused_without_a_figure_do_not_fit(limit, refused_above):
  """Candidates above a size the compiler refuses without naming memory (a
  fusion over a TPU core's vmem) are skipped as not fitting: the choice is
  brute force's over the peaks with those removed."""
  affine = _affine_peak(state=100, per_example=70, remat_saving=0.3)
  peak = lambda m, r: None if m > refused_above else affine(m, r)
  sizes = sizing.microbatch_candidates(300, multiple=2)
  variants = _variants("none", "layer")
  got = sizing.choose(peak, sizes=sizes, max_batch=300, variants=variants,
                      limit_bytes=limit, memory_source="test")
  best = _brute_force(lambda m, r: float("inf") if peak(m, r) is None
                      else peak(m, r), sizes, 300, variants, limit)
  assert got.fits and best is not None
  assert (got.microbatch_size,
          sizing.Variant(got.remat, got.ghost_summation)) == best[2:]
  assert got.peak_bytes == peak(*best[2:]) <= limit
  assert any(t["peak_bytes"] is None for t in got.tried)

  nothing = sizing.choose(lambda m, r: None, sizes=sizes, max_batch=300,
                          variants=variants, limit_bytes=limit,
                          memory_source="test")
  assert not nothing.fits and nothing.peak_bytes is None
  assert nothing.microbatch_size == sizes[-1]
  assert "refused by the compiler" in nothing.summary()


@pytest.mark.parametrize("fixed, expected, said", [
    (2048, 1085, True),   # above the padded batch: one call of it, said
    (1085, 1085, False),
    (500, 500, False),    # below: as given, three calls
    (None, 1085, False),  # unset: the whole batch
])
def test_a_fixed_microbatch_is_capped_at_the_padded_batch(fixed, expected,
                                                         said, capsys):
  config = types.SimpleNamespace(microbatch_size=fixed,
                                 model_config=t5.T5Config(remat="none"))
  choice, key = sizing.size_steps(
      config, 1085, mesh=partitioning.make_mesh(devices=jax.devices()[:1]),
      rules=partitioning.DATA_PARALLEL_RULES, rows={}, place=None,
      model_dir="", dry_run=True)
  assert key is None
  assert (choice.microbatch_size, choice.accumulation_steps) == (
      expected, -(-1085 // expected))
  line = "MICROBATCH_SIZE=2048 is above the padded batch of 1085 rows"
  assert (line in capsys.readouterr().out) == said
