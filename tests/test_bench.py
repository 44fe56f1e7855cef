"""`python -m dpjax.bench`, and the compute path it measures: bf16 compute
with float32 master params and DP arithmetic, fused attention."""
import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.training import state as state_lib, step as step_lib, step_cost
from dpjax.bench import step as bench
from dpjax.models import common, t5
from dpjax.privacy import clipping, optimizers
from dpjax.privacy.secret import RunSecret
from tests import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"model", "mode", "dtype", "batch", "microbatch", "lengths",
          "tokens_per_step", "params", "steps", "warmup", "step_time_s",
          "tokens_per_s", "examples_per_s", "peak_memory_bytes",
          "peak_memory_source", "mfu", "flops", "bytes_accessed",
          "cost_parts", "device_kind", "jax_version", "xla_flags",
          "command"}
SHAPE = ["--vocab=128", "--seq=16", "--batch=4", "--microbatch=2",
         "--steps=2", "--warmup=1"]
TINY = ["--model=gpt2_tiny", "--layers=1", *SHAPE]  # one layer: cheaper


def gpt2_tiny_params(vocab: int, layers: int) -> int:
  """GPT-2 parameter count by hand: d_model 64, `layers` layers, 256
  positions."""
  d, positions = 64, 256
  attention = 4 * (d * d + d)
  mlp = d * 4 * d + 4 * d + 4 * d * d + d
  norms = 2 * 2 * d
  return vocab * d + positions * d + layers * (attention + mlp + norms) + 2 * d


def check_result(result, mode):
  assert FIELDS <= set(result), FIELDS - set(result)
  assert result["mode"] == mode and result["steps"] == 2
  assert result["tokens_per_step"] == 4 * 16
  assert result["params"] == gpt2_tiny_params(128, layers=1)
  assert result["tokens_per_s"] == pytest.approx(
      64 / result["step_time_s"], rel=1e-3)
  assert result["peak_memory_bytes"] > 0
  # On a CPU the peak is the compiled step's memory analysis, reported too.
  assert result["peak_memory_source"] == "memory_analysis"
  assert result["memory_analysis"]["peak_estimate_bytes"] == (
      result["peak_memory_bytes"])
  assert result["mfu"] is None  # no known peak for a CPU
  assert result["flops"] > 0 and result["bytes_accessed"] > 0


def test_cli_prints_one_json_line():
  # The suite's cheap code generation (tests/xla_env.py), and a flag of our
  # own.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
      [os.environ.get("XLA_FLAGS", ""),
       "--xla_cpu_enable_concurrency_optimized_scheduler=false"]).strip())
  proc = subprocess.run([sys.executable, "-m", "dpjax.bench", *TINY,
                         "--mode=nodp"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert len(lines) == 1, proc.stdout
  result = json.loads(lines[0])
  check_result(result, "nodp")
  assert result["command"] == "python -m dpjax.bench " + " ".join(
      TINY + ["--mode=nodp"])
  assert result["xla_flags"] == env["XLA_FLAGS"]


# jax-privacy is a dependency (BandMF), so its clipping is measured too.
@pytest.mark.parametrize("mode", ["vmap", "ghost", "jax_privacy"])
def test_dp_modes(mode, capsys):
  assert bench.main(TINY + [f"--mode={mode}"]) == 0
  check_result(json.loads(capsys.readouterr().out), mode)


def test_memory_only_compiles_t5_without_running(capsys):
  assert bench.main(["--model=t5_tiny", "--layers=1", "--vocab=64",
                     "--input_length=16", "--target_length=8", "--batch=4",
                     "--mode=nodp", "--memory_only"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["tokens_per_step"] == 4 * (16 + 8)
  assert "step_time_s" not in result
  # The arguments hold at least the float32 params and both Adam moments.
  assert result["memory_analysis"]["argument_size_in_bytes"] >= (
      3 * 4 * result["params"])
  assert result["flops"] > 0 and result["bytes_accessed"] > 0


def test_memory_only_without_the_cost_analysis(capsys):
  # The step of test_memory_only_with_remat: compiled once (the cache).
  assert bench.main(["--model=t5_tiny", "--layers=1", "--vocab=64",
                     "--seq=16", "--batch=2", "--mode=ghost", "--remat=layer",
                     "--memory_only", "--no_cost"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["flops"] is None and result["cost_parts"] is None
  assert result["memory_analysis"]["peak_estimate_bytes"] > 0


def test_memory_only_with_remat(capsys):
  assert bench.main(["--model=t5_tiny", "--layers=1", "--vocab=64",
                     "--seq=16", "--batch=2", "--mode=ghost", "--remat=layer",
                     "--memory_only"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["remat"] == "layer"
  assert result["residual_bytes"] > 0 and "memory_analysis" in result


@pytest.mark.parametrize("mode", ["nodp", "ghost"])
def test_a_lora_step_trains_and_keeps_state_for_the_adapters_only(mode,
                                                                   capsys):
  lora = ["--model=gpt2_tiny", *SHAPE]  # two layers: adapters on each
  assert bench.main(lora + [f"--mode={mode}", "--lora_rank=2"]) == 0
  result = json.loads(capsys.readouterr().out)
  d, rank, layers = 64, 2, 2  # adapters on q, k, v, o: a [d, r] and b [r, d]
  assert result["trained_params"] == layers * 4 * 2 * d * rank
  assert result["params"] == (gpt2_tiny_params(128, layers)
                              + result["trained_params"])
  assert result["lora_rank"] == 2 and result["step_time_s"] > 0
  # Adam's moments for the adapters alone: the arguments are the float32
  # params and two moments of each trained leaf (and counters). The cost
  # analysis of a LoRA step is the timed run's.
  assert bench.main(lora + [f"--mode={mode}", "--lora_rank=2",
                            "--memory_only", "--no_cost"]) == 0
  arguments = json.loads(capsys.readouterr().out)["memory_analysis"][
      "argument_size_in_bytes"]
  state = 4 * (result["params"] + 2 * result["trained_params"])
  assert state <= arguments < state + 4 * result["params"]


# --- XLA cost analysis: compile only, nothing timed. ------------------------

COST = ["--model=gpt2_tiny", "--layers=1", "--vocab=128", "--seq=16",
        "--batch=4", "--microbatch=2", "--cost_only"]


_COST_LINES = """
import sys
from dpjax.bench import step
for mode in ("nodp", "vmap", "ghost"):
  extra = [] if mode == "nodp" else ["--compare_nodp"]
  assert step.main(sys.argv[1:] + extra + ["--mode=" + mode]) == 0
"""


# The suite's cheap code generation but its emitters: LLVM's optimisation
# level and passes and one codegen thread change no HLO, so no cost
# analysis or loop count (the same lines either way), and a --cost_only
# line runs nothing they generate.
LLVM_FLAGS = [f for f in xla_env.FAST_COMPILE if "fusion_emitters" not in f]


@pytest.fixture(scope="module")
def cost_lines():
  """{mode: JSON line}: nodp alone, vmap and ghost with --compare_nodp, in a
  process compiling with XLA's own emitters: what is asserted of the
  programs' loops is what they leave (the suite's classic emitters lower a
  scatter as a loop: tests/xla_env.py)."""
  env = xla_env.default_codegen(JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = " ".join([env["XLA_FLAGS"], *LLVM_FLAGS]).strip()
  proc = subprocess.run([sys.executable, "-c", _COST_LINES, *COST], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.splitlines()]
  return {line["mode"]: line for line in lines}


def test_cost_fields_exist_and_add_up(cost_lines):
  for mode, line in cost_lines.items():
    parts = line["cost_parts"]
    assert parts["microbatches"] == 2
    for part in ("accumulate", "apply"):
      assert parts[part]["flops"] > 0 and parts[part]["bytes_accessed"] > 0
    # No loop left in a microbatch's accumulate, so K x it is what runs.
    assert parts["accumulate"]["while_loops"] == 0
    for field in ("flops", "bytes_accessed"):
      assert line[field] == 2 * parts["accumulate"][field] + (
          parts["apply"][field])
  assert "flops_vs_nodp" not in cost_lines["nodp"]


def test_nodp_flops_cover_every_microbatch(cost_lines):
  """At least 6 flops per matmul weight and token (forward + backward): all
  4 examples' tokens, not one microbatch's, and not twice them."""
  d, layers, vocab = 64, 1, 128
  matmul_weights = vocab * d + layers * 12 * d * d  # logits, attention, MLP
  line = cost_lines["nodp"]
  forward_backward = line["flops"] - line["cost_parts"]["apply"]["flops"]
  assert 1 <= forward_backward / (6 * matmul_weights * 4 * 16) < 2


def test_dp_does_more_work_and_ratios_match_separate_runs(cost_lines):
  nodp = cost_lines["nodp"]
  for mode in ("vmap", "ghost"):
    line = cost_lines[mode]
    assert line["flops"] >= nodp["flops"]
    assert line["nodp_flops"] == nodp["flops"]
    assert line["nodp_bytes_accessed"] == nodp["bytes_accessed"]
    assert line["nodp_cost_parts"] == nodp["cost_parts"]
    assert line["flops_vs_nodp"] == pytest.approx(
        line["flops"] / nodp["flops"], rel=1e-12)
    assert line["bytes_vs_nodp"] == pytest.approx(
        line["bytes_accessed"] / nodp["bytes_accessed"], rel=1e-12)
  assert cost_lines["ghost"]["ghost_summation"] == "auto"


class _Compiled:
  """A compiled program's stand-in: its cost analysis and HLO text."""

  def __init__(self, analysis, text=""):
    self.analysis, self.text = analysis, text

  def cost_analysis(self):
    return self.analysis

  def as_text(self):
    return self.text


WHILE = "%w = (s32[]) while(%t), condition=%c, body=%b\n"
CONCAT = '%c = f32[8] custom-call(%a, %b), custom_call_target="ConcatBitcast"\n'
CROP = ('%z = pred[512] custom-call(%m), custom_call_target="ZeroCrop", '
        'output_to_operand_aliasing={{}: (0, {})}\n')


def test_cost_analysis_of_a_list_or_a_dict():
  """Older jax returns a list of one dict per program, newer jax the dict."""
  analysis = {"flops": 6.0, "bytes accessed": 8.0, "transcendentals": 1.0}
  expected = {"flops": 6.0, "bytes_accessed": 8.0, "seconds": None,
              "cycles": None, "while_loops": 1, "windowed_einsum_loops": 0,
              "custom_calls": {}}
  assert step_cost.cost_analysis(_Compiled(analysis, WHILE)) == expected
  assert step_cost.cost_analysis(_Compiled([analysis], WHILE)) == expected


@pytest.mark.parametrize("text, estimate, seconds", [
    ("", 2.5e-3, 2.5e-3),  # the compiler's own
    ("", -1.0, None),  # unknown
    (2 * CONCAT, -2 + 2.5e-3, 2.5e-3),  # two free joins, -1 s each
    (2 * CONCAT, -3 + 2.5e-3, None),  # and an op it has no model for
    (CONCAT + CROP, -2 + 2.5e-3, 2.5e-3),  # FSDP's padding cleared in place
    (WHILE, 2.5e-3, None),  # a loop's body counted once
])
def test_the_tpu_estimate_with_what_it_leaves_out(text, estimate, seconds):
  """The TPU compiler counts -1 s for an op it has no model for; its
  buffer joins (ConcatBitcast) move nothing and the padding FSDP's
  collectives leave is cleared in place (ZeroCrop): both are added back,
  anything else unknown, or a loop, leaves no estimate."""
  cost = step_cost.cost_analysis(_Compiled(
      {"flops": 6.0, "bytes accessed": 8.0, "optimal_seconds": estimate},
      text))
  assert cost["seconds"] == (None if seconds is None
                             else pytest.approx(seconds, rel=1e-9))
  assert cost["custom_calls"] == {
      name: text.count(f'"{name}"') for name in ("ConcatBitcast", "ZeroCrop")
      if name in text}


FUSION = ('%f{i} = f32[8] fusion(%a), kind=kLoop, calls=%c{i}, backend_config='
          '{{"window_config":{{"estimated_cycles":"{cycles}"}}}}\n')


def _loop(name: str, count: int, body: str) -> str:
  """A jax loop's condition (counter < count) and `body`, as computations."""
  return (f"%{name}_cond (p: (s32[])) -> pred[] {{\n"
          f"  %{name}_n = s32[]{{:T(128)}} constant({count})\n"
          f"  %{name}_i = s32[] get-tuple-element(%p), index=0\n"
          f"  ROOT %{name}_lt = pred[] compare(%{name}_i, %{name}_n), "
          f"direction=LT\n}}\n\n"
          f"%{name}_body (p: (s32[])) -> (s32[]) {{\n{body}}}\n\n")


def _while(name: str) -> str:
  return (f"  %{name} = (s32[]) while(%t), condition=%{name}_cond, "
          f"body=%{name}_body\n")


# A loop of 12 (each iteration 1000 cycles and an inner loop of 3 x 10)
# after an op of 100.
NESTED = (_loop("inner", 3, "  " + FUSION.format(i=2, cycles=10))
          + _loop("outer", 12, "  " + FUSION.format(i=1, cycles=1000)
                  + _while("inner"))
          + "ENTRY %main () -> f32[] {\n  " + FUSION.format(i=0, cycles=100)
          + _while("outer") + "}\n")


@pytest.mark.parametrize("text, cycles", [
    ("", None),  # no per-op estimates (a GPU, a CPU)
    (FUSION.format(i=0, cycles=1200) + FUSION.format(i=1, cycles=34), 1234.0),
    (FUSION.format(i=0, cycles=1200) + WHILE, None),  # a loop it cannot count
    (NESTED, 100 + 12 * (1000 + 3 * 10)),  # each iteration counted
    (NESTED.replace("constant(3)", "parameter(1)"), None),
])
def test_the_cycles_are_the_sum_of_the_ops_estimates(text, cycles):
  """Each op's estimate, a loop's body once per iteration where its trip
  count reads as jax's loops write it (`step_cost.program_cycles`)."""
  cost = step_cost.cost_analysis(_Compiled(
      {"flops": 6.0, "bytes accessed": 8.0, "optimal_seconds": 1e-3}, text))
  assert cost["cycles"] == cycles
  total = step_cost.combine(cost, {**cost, "cycles": 7.0}, 3)
  assert total["cycles"] == (None if cycles is None else 3 * cycles + 7)


def test_residual_bytes_by_hand():
  """The VJP of w -> w.x w.r.t. w keeps x alone: 4 bytes per float32."""
  x = jax.ShapeDtypeStruct((3, 5), jnp.float32)
  w = jax.ShapeDtypeStruct((5,), jnp.float32)
  assert bench.residual_bytes(lambda w, x: jnp.sum(x @ w), w, x) == 4 * 15


def test_model_overrides():
  """--vocab and --layers (T5: encoder and decoder each) over the gin file."""
  gpt2 = bench.model_config("gpt2_tiny", dtype="float32", vocab_size=128,
                            num_layers=1)
  assert (gpt2.vocab_size, gpt2.num_layers, gpt2.d_model) == (128, 1, 64)
  assert bench.model_config("gpt2_tiny", dtype="float32").num_layers == 2
  t5_config = bench.model_config("t5_tiny", dtype="float32", num_layers=1)
  assert (t5_config.num_encoder_layers, t5_config.num_decoder_layers) == (1, 1)
  with pytest.raises(SystemExit):
    bench.parse_args(["--model=gpt2_tiny", "--layers=0"])


def test_a_scanned_t5_is_costed_from_its_loop_unrolled(capsys):
  """--scan_layers: accumulate's figures come from its loop unrolled at one
  and two layers per stack (the extrapolation itself is checked against the
  whole loop unrolled in tests/test_dry_run.py); GPT-2 has no scanned
  form."""
  assert bench.main(["--model=t5_tiny", "--vocab=128", "--seq=8", "--batch=4",
                     "--mode=nodp", "--cost_only", "--scan_layers"]) == 0
  line = json.loads(capsys.readouterr().out)
  assert line["scan_layers"] is True
  accumulate = line["cost_parts"]["accumulate"]
  assert accumulate["extrapolated_to"] == {
      "num_encoder_layers": 2, "num_decoder_layers": 2}
  assert accumulate["flops"] > 0
  assert line["flops"] == line["cost_parts"]["accumulate"]["flops"] + (
      line["cost_parts"]["apply"]["flops"])
  assert bench.main(["--model=gpt2_tiny", "--scan_layers"]) == 1
  assert "no scanned form" in json.loads(capsys.readouterr().out)["error"]


def test_unavailable_setups_are_json_errors(capsys):
  assert bench.main(["--model=no_such_model"]) == 1
  assert "unknown model 'no_such_model'" in json.loads(
      capsys.readouterr().out)["error"]
  assert bench.main(TINY + ["--mode=jax_privacy", "--lora_rank=2"]) == 1
  assert "no trainable mask" in json.loads(capsys.readouterr().out)["error"]


def test_mfu_and_device_peaks():
  # 6 * 1e9 params * 1e4 tokens/s over two 989 TFLOP/s devices.
  assert bench.mfu(10**9, 1e4, 989e12, 2) == pytest.approx(6e13 / 1.978e15)
  assert bench.mfu(10**9, 1e4, None, 1) is None
  assert bench.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert bench.peak_flops("NVIDIA H100 PCIe") == 756e12
  assert bench.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert bench.peak_flops("TPU v5 lite") == 197e12
  assert bench.peak_flops("cpu") is None


# --- Mixed precision: bf16 compute, float32 master params and DP math. -----


def _tiny_t5(dtype):
  return t5.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                     num_encoder_layers=1, num_decoder_layers=1,
                     dropout_rate=0.0, dtype=dtype)


def _t5_batch(n, length=8, seed=0):
  rng = np.random.default_rng(seed)
  tok = lambda: rng.integers(1, 64, (n, length)).astype(np.int32)
  return {"encoder_input_tokens": tok(), "decoder_input_tokens": tok(),
          "decoder_target_tokens": tok(),
          "decoder_loss_weights": np.ones((n, length), np.float32)}


def test_bfloat16_step_keeps_float32_params_grads_and_norms():
  params, _ = t5.init_params(_tiny_t5("float32"), jax.random.PRNGKey(0),
                             input_length=8, target_length=8)
  batch, mask = _t5_batch(4), np.ones(4, np.float32)
  norms = {}
  for dtype in ("bfloat16", "float32"):
    clipped = clipping.clipped_grad(t5.make_example_loss(_tiny_t5(dtype)),
                                    clip_norm=1.0)
    grads, stats = jax.jit(clipped)(params, batch, mask)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
    assert stats.norms.dtype == jnp.float32
    norms[dtype] = stats.norms
  # bf16 matmuls move the norms by bf16 rounding only.
  np.testing.assert_allclose(norms["bfloat16"], norms["float32"], rtol=3e-2)

  # The update (noise, Adam) keeps params and moments float32; dtypes only,
  # so traced, not compiled.
  tx = optimizers.dp_optimizer(optax.adam(1e-3),
                               noise_multipliers={"loss": 1.0},
                               sensitivities={"loss": 1.0}, normalizer=4)
  state = jax.eval_shape(step_lib.make_apply(tx),
                         state_lib.init_state(params, tx), {"loss": grads},
                         RunSecret.pinned(0).noise_key())
  adam = state.opt_state[0]
  assert {x.dtype for x in jax.tree.leaves((state.params, adam.mu, adam.nu))
          } == {jnp.dtype("float32")}


# --- Attention: a float64 reference, and what its backward pass keeps. ------


def _reference_attention(q, k, v, bias, scale, keep=None, rate=0.0):
  """float64 numpy: softmax(scale q k^T + bias) v, heads joined, and its
  vjp for the cotangent `g` [b, q, h, d]: (out, vjp(g) -> dq, dk, dv).
  `keep` [b, h, q, k]: the weights kept by dropout at `rate`."""
  q, k, v, bias = (np.asarray(x, np.float64) for x in (q, k, v, bias))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  drop = (lambda p: p) if keep is None else (
      lambda p: np.where(keep, p / (1 - rate), 0.0))
  out = np.einsum("bhqk,bkhd->bqhd", drop(probs), v)

  def vjp(g):
    g = np.asarray(g, np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", drop(probs), g)
    dprobs = drop(np.einsum("bqhd,bkhd->bhqk", g, v))
    dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", dlogits, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", dlogits, q) * scale
    return dq, dk, dv

  return out.reshape(*out.shape[:-2], -1), vjp


def _attention_inputs(queries, keys, bias_shape):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, queries, 3, 4)).astype(np.float32)
  k, v = (rng.normal(size=(2, keys, 3, 4)).astype(np.float32) for _ in "kv")
  bias = rng.normal(size=bias_shape).astype(np.float32)
  bias[..., -2:] = -1e10  # masked keys
  return q, k, v, bias


_ATTENTION_CASES = [
    (6, 6, (2, 1, 6, 6), None),     # GPT-2: 1/sqrt(d), causal bias
    (1, 6, (1, 1, 1, 6), None),     # GPT-2 cached decoding: one query
    (5, 7, (2, 3, 5, 7), 1.0),      # T5: relative-position + padding bias
    (1, 7, (1, 3, 1, 7), 1.0),      # T5 cached decoding
]


@pytest.mark.parametrize("queries, keys, bias_shape, scale", _ATTENTION_CASES)
def test_attention_and_its_gradients_match_a_float64_reference(
    queries, keys, bias_shape, scale):
  q, k, v, bias = _attention_inputs(queries, keys, bias_shape)
  expected, reference_vjp = _reference_attention(
      q, k, v, bias, 0.5 if scale is None else scale)
  g = np.random.default_rng(1).normal(size=expected.shape).astype(np.float32)

  @functools.partial(jax.jit, static_argnums=0)
  def out_and_grads(dtype, q, k, v):
    out, vjp = jax.vjp(lambda *qkv: common.scaled_attention(
        *qkv, bias, dtype, scale=scale), q, k, v)
    return out, vjp(g.astype(dtype))

  out, grads = out_and_grads(jnp.float32, q, k, v)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  for got, want in zip(grads, reference_vjp(g.reshape(*g.shape[:2], 3, 4))):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # bf16: logits and softmax accumulate in float32, weighted sums in bf16.
  out16, grads16 = out_and_grads(jnp.bfloat16, q, k, v)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(out16), expected, rtol=3e-2, atol=3e-2)
  for got, want in zip(grads16, reference_vjp(g.reshape(*g.shape[:2], 3, 4))):
    np.testing.assert_allclose(np.float32(got), want, rtol=5e-2, atol=5e-2)


def test_attention_dropout_drops_weights_like_flax_and_recomputes_its_mask():
  """Dropout keeps each weight with probability 1 - rate, scaled up by
  1 / (1 - rate), the mask drawn from the key as `flax.linen.Dropout` draws
  it; the backward pass regenerates that same mask from the key."""
  q, k, v, bias = _attention_inputs(5, 7, (2, 3, 5, 7))
  key, rate = jax.random.PRNGKey(3), 0.25
  logits_shape = (2, 3, 5, 7)
  keep = np.asarray(jax.random.bernoulli(key, 1 - rate, logits_shape))
  assert 0 < keep.mean() < 1
  flax_dropped = nn.Dropout(rate).apply(
      {}, np.ones(logits_shape, np.float32), deterministic=False, rng=key)
  np.testing.assert_array_equal(np.asarray(flax_dropped) > 0, keep)

  expected, reference_vjp = _reference_attention(q, k, v, bias, 1.0, keep, rate)
  g = np.random.default_rng(1).normal(size=(2, 5, 12)).astype(np.float32)
  out, vjp = jax.vjp(lambda *qkv: common.scaled_attention(
      *qkv, bias, jnp.float32, scale=1.0, dropout_rate=rate, dropout_rng=key),
                     q, k, v)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  for got, want in zip(vjp(g), reference_vjp(g.reshape(2, 5, 3, 4))):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dropout", [False, True])
def test_attention_backward_keeps_only_its_inputs(dropout):
  """Rematerialised (the default), the backward pass keeps q, k, v and the
  bias; differentiated as written (`remat=False`), it keeps the `[b, h, q,
  k]` softmax twice (float32 and bf16) and the dropout mask."""
  q, k, v, bias = (jnp.asarray(x, jnp.bfloat16 if i < 3 else jnp.float32)
                   for i, x in enumerate(_attention_inputs(16, 16,
                                                           (2, 3, 16, 16))))
  rng = jax.random.PRNGKey(0) if dropout else None

  def kept_bytes(remat):
    _, vjp = jax.vjp(lambda q, k, v: common.scaled_attention(
        q, k, v, bias, jnp.bfloat16, dropout_rate=0.1, dropout_rng=rng,
        remat=remat), q, k, v)
    return sum(x.nbytes for x in jax.tree.leaves(vjp))

  qkv = sum(x.nbytes for x in (q, k, v))
  assert kept_bytes(remat=True) <= qkv + bias.nbytes + 16  # + the key
  assert kept_bytes(remat=False) >= qkv + 6 * bias.size


def test_t5_cached_decoding_reproduces_the_full_forward_pass():
  """Cached decoding (one query against the cache) gives the full forward
  pass's logits position by position."""
  cfg = _tiny_t5("float32")
  params, _ = t5.init_params(cfg, jax.random.PRNGKey(1), input_length=8,
                             target_length=8)
  model = t5.T5Transformer(cfg)
  batch = _t5_batch(2, seed=1)
  enc, dec = batch["encoder_input_tokens"], batch["decoder_input_tokens"]

  @jax.jit
  def forward(params):
    return model.apply({"params": params}, enc, dec)

  @jax.jit
  def decode(params):
    encoded = model.apply({"params": params}, enc, method=model.encode)
    run = lambda tokens, cache: model.apply(
        {"params": params, **cache}, encoded, enc, tokens, decode=True,
        method=model.decode, mutable=["cache"])
    _, cache = run(dec, {})  # creates the cache
    steps = []
    for i in range(3):
      logits, cache = run(dec[:, i:i + 1], cache)
      steps.append(logits)
    return jnp.concatenate(steps, axis=1)

  np.testing.assert_allclose(decode(params), forward(params)[:, :3],
                             rtol=1e-4, atol=1e-5)


def test_per_layer_extrapolation_adds_each_layer_and_refuses_a_negative_one():
  """Each layer of a stack adds what its second one adds; where the second
  adds less than nothing (a one-layer program laid out unlike the others),
  what the third adds; a field still below zero is None, not extrapolated
  below zero. Each layer count is costed once (each is a compile)."""
  calls = []

  def cost_of(counts):
    # flops: 1 + 2 per encoder layer + 5 per decoder layer. bytes: the
    # one-encoder-layer program is 30 too dear, then 4 per encoder layer;
    # decoder layers add less than nothing. seconds: unknown.
    e, d = counts["num_encoder_layers"], counts["num_decoder_layers"]
    calls.append((e, d))
    return {"flops": 1.0 + 2 * e + 5 * d,
            "bytes_accessed": 100.0 + 4 * e + 30 * (e == 1) - d,
            "seconds": None}

  total = step_cost.per_layer_extrapolation(
      cost_of, {"num_encoder_layers": 24, "num_decoder_layers": 3})
  assert total["flops"] == 1 + 2 * 24 + 5 * 3
  assert total["bytes_accessed"] is None and total["seconds"] is None
  assert total["per_layer_from"] == {"num_encoder_layers": 3,
                                     "num_decoder_layers": 3}
  assert sorted(calls) == sorted(set(calls)) == [(1, 1), (1, 2), (1, 3),
                                                 (2, 1), (3, 1)]
  assert total["extrapolated_to"] == {"num_encoder_layers": 24,
                                      "num_decoder_layers": 3}
  # The encoder alone: its third layer's 4 a layer, from the 1-layer base.
  encoder = step_cost.per_layer_extrapolation(
      cost_of, {"num_encoder_layers": 24, "num_decoder_layers": 1})
  assert encoder["bytes_accessed"] == 100 + 4 + 30 - 1 + 23 * 4


def test_combine_counts_k_microbatches_and_keeps_unknowns_unknown():
  """A logical step is k accumulate calls and one apply; a field either
  part lacks (an extrapolation refused, a GPU's time) is None, not an
  error (T5-XL's v4-32 dry run failed there once)."""
  accumulate = {"flops": 10.0, "bytes_accessed": None, "seconds": 0.5}
  apply = {"flops": 1.0, "bytes_accessed": 7.0, "seconds": 0.25}
  total = step_cost.combine(accumulate, apply, 7)
  assert (total["flops"], total["bytes_accessed"], total["seconds"]) == (
      71.0, None, 3.75)
  assert total["parts"] == {"accumulate": accumulate, "apply": apply}
