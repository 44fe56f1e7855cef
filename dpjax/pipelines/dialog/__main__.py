"""The domain-privacy experiment of Kabra & Elenberg, Findings of EMNLP 2023,
arXiv 2305.14208 (its Figure 1 table):

  python -m dpjax.pipelines.dialog table --output_dir=runs/dialog \\
      [--prompt_domain=AIRLINE] [--modes=domain_only,public,pub_redacted,
      private,jft,redaction_schedule] [--policies=keyword,classifier] \\
      [--epsilon=8] [--num_conversations=10] [--prompts_per_conversation=10] \\
      [--num_samples=10] [--max_new_tokens=64] \\
      [--gin_file=dialog_sample.gin] [--gin.NAME=VALUE ...]

and the user-level membership inference (LiRA) of non-private, example-level
and user-level DP training at the same ε (`dpjax.pipelines.dialog.membership`):

  python -m dpjax.pipelines.dialog membership --output_dir=runs/dialog_membership \\
      [--settings=nonprivate,example,user] [--epsilon=8] [--num_models=8] \\
      [--gin_file=dialog_sample_user_level.gin] [--gin.NAME=VALUE ...]

Defaults run on the embedded MultiDoGo sample (tiny GPT-2, CPU). With the
release's files: `--gin_file=dialog_gpt2.gin` (`dialog_gpt2_user_level.gin`
for membership)
`--gin.register_multidogo_tasks.data_dir="'/data/multidogo/unannotated'"`.
Rerunning the same command skips every finished run and attack.
"""
from __future__ import annotations

import argparse

from dpjax import errors
from dpjax.pipelines import harness
from dpjax.pipelines.dialog import experiment, lira, membership

_LIST = lambda s: [x for x in s.split(",") if x]


def _add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("experiment", choices=["table", "membership"])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--prompt_domain", default="AIRLINE")
  p.add_argument("--modes", type=_LIST, default=list(experiment.MODES))
  p.add_argument("--policies", type=_LIST, default=list(experiment.POLICIES))
  p.add_argument("--epsilon", type=float, default=8.0)
  p.add_argument("--num_conversations", type=int, default=10)
  p.add_argument("--prompts_per_conversation", type=int, default=10)
  p.add_argument("--num_samples", type=int, default=lira.PAPER_NUM_SAMPLES)
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--top_k", type=int, default=lira.PAPER_TOP_K)
  p.add_argument("--top_fraction", type=float, default=0.1)
  p.add_argument("--classifier_epochs", type=float, default=3.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch_size", type=int, default=64)
  p.add_argument("--settings", type=_LIST, default=list(membership.SETTINGS),
                 help="membership: the trainings attacked")
  p.add_argument("--num_models", type=int, default=8,
                 help="membership: models per setting (each user trains half)")


def _run(args, gin_files, bindings) -> dict:
  lists = ((("settings", args.settings, membership.SETTINGS),)
           if args.experiment == "membership" else
           (("modes", args.modes, experiment.MODES),
            ("policies", args.policies, experiment.POLICIES)))
  for name, given, known in lists:
    if not given or set(given) - set(known):
      raise errors.UsageError(f"--{name} takes a comma-separated subset of "
                               f"{','.join(known)}, got {','.join(given)!r}")
  if args.experiment == "membership":
    return membership.run(
        args.output_dir, settings=args.settings, epsilon=args.epsilon,
        num_models=args.num_models, seed=args.seed,
        gin_files=gin_files or ("dialog_sample_user_level.gin",),
        bindings=bindings, batch_size=args.batch_size)
  return experiment.domain_privacy_table(
      args.output_dir, prompt_domain=args.prompt_domain, modes=args.modes,
      policies=args.policies, epsilon=args.epsilon,
      gin_files=gin_files or ("dialog_sample.gin",), bindings=bindings,
      num_conversations=args.num_conversations,
      prompts_per_conversation=args.prompts_per_conversation,
      num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
      top_k=args.top_k, top_fraction=args.top_fraction,
      classifier_epochs=args.classifier_epochs, seed=args.seed,
      batch_size=args.batch_size)


def main(argv=None) -> dict:
  """Runs `python -m dpjax.pipelines.dialog`."""
  return harness.run_command(argv, "The domain-privacy experiment of dpjax.",
                             _add_arguments, _run)


if __name__ == "__main__":
  harness.command_main(main)
