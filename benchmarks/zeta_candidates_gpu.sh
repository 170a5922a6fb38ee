#!/usr/bin/env bash
# One device call for the untimed ZETA changes (indexed.KEY_GRADS="inverse",
# SELECT_OVERRIDES["split"], the per-row sink): the indexed-kernel tests on the GPU, where
# programs run concurrently (the interpreter runs them one after another; the ZETA tests build
# CPU tensors, so they stay on the CPU), zeta_bench's correctness section (the Triton path in
# bf16 against the fp32 definition, with and without a sink) at one small speed point, then the
# alternating A/B with gradient, selection and memory checks. Usage on the GPU machine, from the
# repository root:
#   SPARSEFOCUS_COMMIT=<hash> bash benchmarks/zeta_candidates_gpu.sh OUT_DIR
set -o pipefail
out=${1:?usage: zeta_candidates_gpu.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 180 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_indexed.py 2>&1 | tail -30 | tee "$out/tests.txt"
timeout 180 python benchmarks/zeta_bench.py --out "$out/bench" --n 4096 --ratio-n 4096 --recall none --no-million 2>&1 | tail -5
timeout 300 python benchmarks/zeta_tiles_ab.py 8192 32768 65536 --reps 2 --key-grads --split-band 2>&1 | tee "$out/candidates_ab.jsonl"
