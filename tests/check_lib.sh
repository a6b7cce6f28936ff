# Shared by the shell tests (source it after setting $bin, the distopt
# binary): a scratch folder, failure counting, expect_error and finish.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# expect_error STATUS PATTERN -- ARGS...: exit status, one line on stderr matching PATTERN.
expect_error() {
  local want=$1 pattern=$2
  shift 3
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  [ "$got" = "$want" ] || fail "distopt $*: exit $got, want $want"
  [ "$(wc -l <"$tmp/err")" = 1 ] || fail "distopt $*: stderr is not one line: $(cat "$tmp/err")"
  grep -q -- "$pattern" "$tmp/err" || fail "distopt $*: stderr '$(cat "$tmp/err")' lacks '$pattern'"
}

# sanitized: true when $bin is built with AddressSanitizer or ThreadSanitizer,
# which reserve terabytes of address space and cannot run under ulimit -v.
sanitized() { nm "$bin" 2>/dev/null | grep -q "__asan_init\|__tsan_init"; }
# scaled SECONDS: a time limit, four times as long under a sanitizer (which
# runs the program several times slower).
scaled() { if sanitized; then echo $(($1 * 4)); else echo "$1"; fi; }
# worlds N...: the world sizes a loop of mpirun launches runs: all of them,
# or under a sanitizer only the first (each launch there is about ten times
# slower; the sanitizer checks the code paths, which the smallest world
# already takes; the other sizes run in the unsanitized suite).
worlds() { if sanitized; then echo "$1"; else echo "$@"; fi; }

# started PID FILE: waits (at most 60 s) while PID lives until a temporary
# file of FILE (FILE.tmp.*, the metrics, flushed at least once a second) has
# data, i.e. training is under way. PID may be distopt's or mpirun's.
started() {
  local i f
  for i in $(seq 1200); do
    for f in "$2".tmp.*; do [ -s "$f" ] && return 0; done
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# finish NAME: the summary line and the exit status.
finish() {
  if [ "$failures" = 0 ]; then echo "$1: all checks passed"; exit 0; fi
  echo "$1: $failures failed"
  exit 1
}
