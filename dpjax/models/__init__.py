"""Flax models of dpjax, one module each: `t5` (v1.0 / v1.1) and `gpt2`.

Params are plain float32 pytrees with logical axis names; each model module
offers `init_params`, `abstract_params`, `make_example_loss` (one example, for
per-example clipping) and `make_batch_loss`. `hf_t5` / `hf_gpt2` map Hugging
Face state dicts onto them. No TensorFlow here.
"""
