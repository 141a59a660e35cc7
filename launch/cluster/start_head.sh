#!/usr/bin/env bash
# Start the Ray head node of a Kiln cluster on this machine.
#   launch/cluster/start_head.sh [extra `ray start` options]
# Environment: KILN_RAY_PORT (6379), KILN_DASHBOARD_PORT (8265), KILN_NODE_IP (ray's choice).
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

args=(--head --port="$KILN_RAY_PORT" --dashboard-host=0.0.0.0 --dashboard-port="$KILN_DASHBOARD_PORT")
if [[ -n "${KILN_NODE_IP:-}" ]]; then
    args+=(--node-ip-address="$KILN_NODE_IP")
fi
ray start "${args[@]}" "$@"
echo "kiln: head started; on every other node run: launch/cluster/start_worker.sh $(hostname -I 2>/dev/null | awk '{print $1}'):$KILN_RAY_PORT"
