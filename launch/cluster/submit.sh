#!/usr/bin/env bash
# Submit a Kiln training run to the cluster as a Ray job; the job's driver joins the running
# cluster (cluster.address=auto) and logs stream here until the run ends.
#   launch/cluster/submit.sh CONFIG [section.key=value ...]
# Environment: KILN_JOB_ADDRESS (http://127.0.0.1:$KILN_DASHBOARD_PORT, i.e. run this on the head),
# KILN_RUNS_DIR (run directories, on the head node; default: runs/ in this checkout),
# KILN_SUBMIT_ARGS (extra `ray job submit` options, e.g. --no-wait),
# KILN_TRAIN_ARGS (extra `kiln train` options, e.g. --dry-run to print the plan from the cluster).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi
config="$1"
shift
[[ -f "$config" ]] || { echo "kiln: config file not found: $config" >&2; exit 2; }
config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
case "$config" in
    "$KILN_ROOT"/*) config="${config#"$KILN_ROOT"/}" ;;  # inside the uploaded working dir
    *) echo "kiln: $config lies outside $KILN_ROOT; copy it into the checkout so the job can read it" >&2; exit 2 ;;
esac

cd "$KILN_ROOT"
# Check the config here, so a typo fails before anything is submitted.
python -m launch.cli config --config "$config" "$@" >/dev/null

# The job runs in a copy of the checkout that Ray deletes afterwards: keep run directories outside it.
runs="${KILN_RUNS_DIR:-$KILN_ROOT/runs}"
runtime_env='{"excludes": [".venv", ".git", "runs", "**/__pycache__", "*.egg-info"]}'
read -r -a extra <<<"${KILN_SUBMIT_ARGS:-}"
read -r -a train_args <<<"${KILN_TRAIN_ARGS:-}"
# `ray job submit` quotes the entrypoint's words itself (shlex.join), so overrides pass through as given.
exec ray job submit --address "${KILN_JOB_ADDRESS:-http://127.0.0.1:$KILN_DASHBOARD_PORT}" \
    --working-dir "$KILN_ROOT" --runtime-env-json "$runtime_env" "${extra[@]}" -- \
    python -m launch.cli train "${train_args[@]}" --config "$config" logging.root="$runs" "$@" cluster.address=auto
