#!/usr/bin/env bash
# A rank that throws, is killed, or stops answering: the job must end with
# a clear error, not hang. Usage: mpi_failure_test.sh MPIEXEC TEST_BINARY
set -u
mpiexec=$1
bin=$2
failures=0
for scenario in throw kill stall; do
  start=$(date +%s)
  timeout 60 "$mpiexec" -n 3 --oversubscribe "$bin" --scenario "$scenario" >/tmp/mpi_failure.$$ 2>&1
  status=$?
  elapsed=$(( $(date +%s) - start ))
  out=$(cat /tmp/mpi_failure.$$)
  rm -f /tmp/mpi_failure.$$
  if [ "$status" = 0 ] || [ "$status" = 124 ]; then
    echo "FAIL $scenario: exit status $status (0: no error reported; 124: hung)"; failures=$((failures + 1)); continue
  fi
  if [ "$elapsed" -gt 30 ]; then
    echo "FAIL $scenario: took ${elapsed}s"; failures=$((failures + 1)); continue
  fi
  case $scenario in
    throw) want="rank 1: error: rank 1 failed on purpose" ;;
    kill) want="signal 9" ;;
    stall) want="waiting for rank(s) 1" ;;
  esac
  if ! grep -qF "$want" <<<"$out"; then
    echo "FAIL $scenario: output lacks '$want':"; echo "$out" | head -20; failures=$((failures + 1)); continue
  fi
  if grep -q "the collective after the failure completed" <<<"$out"; then
    echo "FAIL $scenario: a rank completed a collective without rank 1"; failures=$((failures + 1)); continue
  fi
  echo "ok $scenario: exit $status after ${elapsed}s: $(grep -F "$want" <<<"$out" | head -1)"
done
echo "mpi failure scenarios: $((3 - failures)) passed, $failures failed"
[ "$failures" = 0 ]
