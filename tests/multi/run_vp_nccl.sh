#!/usr/bin/env bash
# Starts W ranks of a multi-GPU test program (one process per GPU, tests/multi/vp_nccl.cpp) and waits for
# them: exit 0 when every rank passed, 77 when they skipped (fewer GPUs than ranks, or no libnccl.so.2),
# 1 otherwise. NVLink multicast stays off (the GPU machines' rule).
#   run_vp_nccl.sh PROGRAM [W] [--bench]
set -u
bin=$1
W=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
dir=$(mktemp -d)
pids=()
for ((r = 0; r < W; r++)); do
  timeout 300 "$bin" "$r" "$W" "$dir/id" "$@" &
  pids+=($!)
done
rc=0 skipped=0
for p in "${pids[@]}"; do
  wait "$p"
  c=$?
  if [ $c -eq 77 ]; then skipped=1; elif [ $c -ne 0 ]; then rc=1; fi
done
rm -rf "$dir"
[ $rc -ne 0 ] && exit 1
[ $skipped -eq 1 ] && exit 77
exit 0
