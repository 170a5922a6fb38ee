#!/usr/bin/env bash
# One device call for the two untimed ZETA speed-ups (indexed.KEY_GRADS="inverse" and
# SELECT_OVERRIDES["split"]): the kernel and ZETA tests on the GPU, where programs run
# concurrently (the interpreter runs them one after another), then the alternating A/B with
# gradient and memory checks. Usage on the GPU machine, from the repository root:
#   SPARSEFOCUS_COMMIT=<hash> bash benchmarks/zeta_candidates_gpu.sh OUT_DIR
set -o pipefail
out=${1:?usage: zeta_candidates_gpu.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_indexed.py tests/attention/test_zeta.py 2>&1 | tail -30 | tee "$out/tests.txt"
timeout 300 python benchmarks/zeta_tiles_ab.py 8192 32768 65536 --reps 2 --key-grads --split-band 2>&1 | tee "$out/candidates_ab.jsonl"
