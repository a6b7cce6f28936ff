#!/usr/bin/env bash
# Every golden optimizer and scheduler case on the GPU (docs/gpu.md): the
# same pass/fail as on the CPU. Where CUDA cannot run, the refusal must be
# the one-line error, and the test reports itself skipped.
set -uo pipefail
bin=$1
golden=$2
for dir in optim sched; do
  out=$("$bin" replay --check "$golden/$dir" --device cuda 2>&1)
  rc=$?
  if [ $rc -ne 0 ] && grep -qE -- "--device cuda: (no CUDA device|this build has no CUDA)" <<<"$out"; then
    [ "$(wc -l <<<"$out")" -eq 1 ] || { echo "FAIL: the refusal is not one line: $out"; exit 1; }
    echo "skipped: no CUDA device ($out)"
    exit 0
  fi
  echo "$out" | tail -3
  [ $rc -eq 0 ] || { echo "FAIL: replay --check $dir --device cuda exited $rc"; exit 1; }
done
