#!/usr/bin/env bash
# Runs `python -m dpjax.train` on every worker of a Cloud TPU VM slice.
#
#   launch/tpu_pod.sh --name=dpjax-v4-32 --zone=us-central2-b \
#       --accelerator_type=v4-32 [--version=tpu-ubuntu2204-base] \
#       [--project=P] [--spot] [--preflight] [--dry-run] -- \
#       --gin_file=gin/msmarco_t5_xl_eps3.gin --gin.MODEL_DIR=gs://BUCKET/runs/xl
#
# 1. creates the slice, or reuses it if it exists;
# 2. copies this checkout's HEAD (`git archive`) to every worker and installs
#    it there (`pip install -e .` plus JAX for TPU);
# 3. runs the same training command on all workers at once; each joins the
#    job through JAX's TPU detection (DPJAX_CLUSTER_DETECTION=auto). Their
#    output streams here, each line prefixed by the worker's hostname, and is
#    appended to --log.
# --preflight first compiles the exact run for the slice on this machine
# (`python -m dpjax.train ... --dry_run --target=tpu:ACCELERATOR_TYPE`, the
# [tpu] extra: no TPU needed), prints its plan and refuses to go on, before
# anything is created, if the run does not fit the slice (with --dry-run
# too: it is local).
# MODEL_DIR must be shared by all workers (a gs:// path). Rerunning the script
# after a preemption recreates the slice if needed and resumes from the last
# checkpoint. Every flag also reads an environment variable (in brackets).
# --dry-run prints the commands instead of running them.
set -euo pipefail

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
ACCELERATOR_TYPE="${TPU_ACCELERATOR_TYPE:-v4-32}"
VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
PROJECT="${TPU_PROJECT:-}"
SPOT="${TPU_SPOT:-0}"
JAX_SPEC="${DPJAX_JAX_SPEC:-jax[tpu]}"
REMOTE_DIR="${DPJAX_REMOTE_DIR:-dpjax}"
LOG="${DPJAX_LOG:-tpu_pod.log}"
DRY_RUN=0
PREFLIGHT=0

usage() {
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2
  echo "flags: --name [TPU_NAME] --zone [TPU_ZONE] --accelerator_type" \
       "[TPU_ACCELERATOR_TYPE] --version [TPU_VERSION] --project" \
       "[TPU_PROJECT] --spot [TPU_SPOT=1] --jax_spec [DPJAX_JAX_SPEC]" \
       "--remote_dir [DPJAX_REMOTE_DIR] --log [DPJAX_LOG] --preflight" \
       "--dry-run" >&2
  exit "${1:-2}"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name=*) NAME="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --accelerator_type=*) ACCELERATOR_TYPE="${1#*=}" ;;
    --version=*) VERSION="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --spot) SPOT=1 ;;
    --jax_spec=*) JAX_SPEC="${1#*=}" ;;
    --remote_dir=*) REMOTE_DIR="${1#*=}" ;;
    --log=*) LOG="${1#*=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --preflight) PREFLIGHT=1 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "tpu_pod.sh: unknown flag $1" >&2; usage ;;
  esac
  shift
done
[[ -n "$NAME" && -n "$ZONE" ]] || { echo "tpu_pod.sh: --name and --zone are required" >&2; usage; }
[[ $# -gt 0 ]] || { echo "tpu_pod.sh: give the dpjax.train flags after --" >&2; usage; }

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project="$PROJECT")

run() {  # prints the command; runs it unless --dry-run
  printf '+'; printf ' %q' "$@"; printf '\n'
  [[ $DRY_RUN == 1 ]] || "$@"
}

# 0. The preflight: the run compiled for the slice here, in a scratch
#    MODEL_DIR (it writes nothing); a run that does not fit stops here.
if [[ $PREFLIGHT == 1 ]]; then
  SCRATCH="$(mktemp -d -t dpjax-preflight.XXXXXX)"
  PREFLIGHT_CMD=(python3 -m dpjax.train "$@" --gin.MODEL_DIR="'$SCRATCH/run'"
                 --dry_run --target="tpu:$ACCELERATOR_TYPE")
  printf '+'; printf ' %q' "${PREFLIGHT_CMD[@]}"; printf '\n'
  if ! "${PREFLIGHT_CMD[@]}"; then
    rm -rf "$SCRATCH"
    echo "tpu_pod.sh: the preflight refused the run on $ACCELERATOR_TYPE;" \
         "nothing was created" >&2
    exit 2
  fi
  rm -rf "$SCRATCH"
fi

# 1. The slice: reuse it if it exists.
if [[ $DRY_RUN == 0 ]] && "${TPU[@]}" describe "$NAME" "${WHERE[@]}" >/dev/null 2>&1; then
  echo "tpu_pod.sh: reusing TPU slice $NAME"
else
  CREATE=("${TPU[@]}" create "$NAME" "${WHERE[@]}"
          --accelerator-type="$ACCELERATOR_TYPE" --version="$VERSION")
  [[ $SPOT == 1 ]] && CREATE+=(--spot)
  run "${CREATE[@]}"
fi

# 2. The code on every worker.
ARCHIVE="$(mktemp -t dpjax.XXXXXX).tar.gz"
trap 'rm -f "$ARCHIVE"' EXIT
run git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$ARCHIVE" HEAD
run "${TPU[@]}" scp "$ARCHIVE" "$NAME:dpjax.tar.gz" "${WHERE[@]}" --worker=all
INSTALL="rm -rf $(printf %q "$REMOTE_DIR") && mkdir -p $(printf %q "$REMOTE_DIR") && tar -xzf dpjax.tar.gz -C $(printf %q "$REMOTE_DIR") && cd $(printf %q "$REMOTE_DIR") && python3 -m pip install -q -e . $(printf %q "$JAX_SPEC")"
run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$INSTALL"

# 3. The same training command on all workers, logs streamed and kept.
TRAIN="$(printf ' %q' "$@")"
COMMAND="set -o pipefail; cd $(printf %q "$REMOTE_DIR") && DPJAX_CLUSTER_DETECTION=auto python3 -m dpjax.train$TRAIN 2>&1 | sed -u \"s/^/[\$(hostname)] /\""
if [[ $DRY_RUN == 1 ]]; then
  run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$COMMAND"
else
  run "${TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$COMMAND" 2>&1 | tee -a "$LOG"
fi
