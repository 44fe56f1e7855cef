"""dpjax: differentially private training of language models in JAX/Flax."""
