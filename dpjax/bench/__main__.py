"""`python -m dpjax.bench [--suite=NAME] ...`: a suite's table, else one step."""
import sys

from dpjax.bench import step, suite, target_suite

argv = sys.argv[1:]
suite_name = next((a.split("=", 1)[1] for a in argv
                   if a.startswith("--suite=")), None)
if suite_name in target_suite.SUITES:
  sys.exit(target_suite.main(argv))
sys.exit(suite.main(argv) if any(a.startswith("--suite") for a in argv)
         else step.main(argv))
