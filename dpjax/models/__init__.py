"""Flax models of dpjax, one module each: `t5` (v1.0 / v1.1), `gpt2`, `bert`,
`dual_encoder` (a T5 encoder shared by queries and documents).

Params are plain float32 pytrees with logical axis names; each model module
offers `init_params`, `abstract_params`, `make_example_loss` (one example, for
per-example clipping) and `make_batch_loss`. `hf_t5` / `hf_gpt2` / `hf_bert`
map Hugging Face checkpoints onto them (loaded by `dpjax.pretrained`). No
TensorFlow here.
"""
