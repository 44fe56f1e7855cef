"""`python -m dpjax.pipelines.retrieval`: the experiment of `experiment`."""
from dpjax.pipelines import harness
from dpjax.pipelines.retrieval import experiment

if __name__ == "__main__":
  harness.command_main(experiment.main)
