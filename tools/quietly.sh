#!/usr/bin/env bash
# Run one setup step with its output kept in LOG, not on the terminal: a newcomer's first
# command should not print six hundred lines of package-manager output. Lines the step itself
# addresses to the user ("fanfs setup: ...") still show. If the step fails, say which and show
# the end of the log.
#   bash tools/quietly.sh LOG COMMAND [ARGS...]
set -uo pipefail
log=$1
shift
printf '\n$ %s\n' "$*" >>"$log"
"$@" 2>&1 | tee -a "$log" | grep --line-buffered '^fanfs setup:'
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "fanfs setup: failed ($status): $*" >&2
    echo "fanfs setup: the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit "$status"
fi
exit 0
