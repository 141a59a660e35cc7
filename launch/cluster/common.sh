# shellcheck shell=bash
# Shared by the cluster scripts: where Kiln lives and which `ray` to run. Sourced, not executed.

KILN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export KILN_ROOT
# Ray's workers run the Python of the process that started the node, so put Kiln's environment
# first on PATH: every actor and the job's driver then import the same packages.
if [[ -x "$KILN_ROOT/.venv/bin/ray" ]]; then
    export PATH="$KILN_ROOT/.venv/bin:$PATH"
fi
command -v ray >/dev/null || { echo "kiln: no 'ray' on PATH and none in $KILN_ROOT/.venv" >&2; exit 1; }

KILN_RAY_PORT="${KILN_RAY_PORT:-6379}"        # GCS port of the head node
KILN_DASHBOARD_PORT="${KILN_DASHBOARD_PORT:-8265}"  # job submission API

# `ray start` turns on token authentication when a token exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH
# or ~/.ray/auth_token); Ray's CLI clients (`ray job submit`) send it only in token mode, so say so.
if [[ -z "${RAY_AUTH_MODE:-}" && ( -n "${RAY_AUTH_TOKEN:-}" || -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ) ]]; then
    export RAY_AUTH_MODE=token
fi
