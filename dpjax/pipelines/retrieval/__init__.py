"""DP synthetic query generation for retrieval: the experiment
(`experiment`) and its canary audit (`canaries`)."""
