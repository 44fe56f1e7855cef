"""`python -m dpjax.bench [--suite=NAME] ...`: a suite's table, else one step."""
import sys

from dpjax.bench import step, suite

argv = sys.argv[1:]
sys.exit(suite.main(argv) if any(a.startswith("--suite") for a in argv)
         else step.main(argv))
