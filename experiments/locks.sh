# Sourced by the experiment scripts: two copies of a script started side by side (one per core) share its
# runs.  Each run holds a lock while it trains (released when its process ends, however it ends); a copy
# skips a run the other holds, and waits for the result files of runs it needs before reading them.

locked() {  # locked LOCKFILE CMD...: run CMD unless another copy holds LOCKFILE
  local lock=$1 fd
  shift
  mkdir -p "$(dirname "$lock")"
  exec {fd}>"$lock"
  if ! flock -n "$fd"; then
    echo "== $(basename "$lock" .lock): running in another copy, skipping"
    exec {fd}>&-
    return 0
  fi
  "$@"
  exec {fd}>&-
}

wait_for() {  # wait_for RUN_DIR...: until every run has its result.json
  local d
  for d in "$@"; do
    while [[ ! -f "$d/result.json" ]]; do sleep 20; done
  done
}

wait_unlocked() {  # wait_unlocked LOCK_DIR: until no copy holds a run lock under LOCK_DIR (a crashed run's is free)
  local l
  while IFS= read -r -d '' l; do
    flock "$l" true
  done < <(find "$1" -name '*.lock' -print0 2>/dev/null)
}
