"""Text generation from trained models: decoding (greedy, sampling, beam),
PPLM steering, and synthetic-query inference from a model directory."""
