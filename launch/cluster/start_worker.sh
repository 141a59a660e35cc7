#!/usr/bin/env bash
# Join this machine to a Kiln Ray cluster as a worker node.
#   launch/cluster/start_worker.sh HEAD_ADDR[:PORT] [extra `ray start` options]
# HEAD_ADDR is the head node's address as printed by start_head.sh; PORT defaults to KILN_RAY_PORT.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 HEAD_ADDR[:PORT] [ray start options]" >&2
    exit 2
fi
head="$1"
shift
[[ "$head" == *:* ]] || head="$head:$KILN_RAY_PORT"
args=(--address="$head")
if [[ -n "${KILN_NODE_IP:-}" ]]; then
    args+=(--node-ip-address="$KILN_NODE_IP")
fi
ray start "${args[@]}" "$@"
