#!/usr/bin/env bash
# A narrower GPU check than tools/gpu.sh: build, compute-sanitizer racecheck and memcheck over
# the snis, resample, ode_mlp, importance_log_weights and vae_mlp_elbo tables, and the CUDA tests of those ops and
# the VAE options, in
# parallel processes, so the whole check fits in a few minutes.  OUT=/dir bash tools/gpu_new_ops.sh
set -u
OUT=${OUT:?}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
pip install -q torchdiffeq > /dev/null 2>&1
OUT=$OUT SKIP_TESTS=1 SANITIZE_TOOLS=none SKIP_BENCH=1 bash tools/gpu.sh > $OUT/build.txt 2>&1
grep -E "build|fused_ops from" $OUT/summary.txt
PY=python3
S="snis snis_backward resample ode_mlp ode_mlp_backward importance_log_weights importance_log_weights_backward vae_mlp"
(timeout 120 compute-sanitizer --tool racecheck --print-limit 5 $PY tools/sanitize_run.py $S > $OUT/racecheck.txt 2>&1; echo "racecheck rc=$?" >> $OUT/racecheck.txt) &
(timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $PY tools/sanitize_run.py $S > $OUT/memcheck.txt 2>&1; echo "memcheck rc=$?" >> $OUT/memcheck.txt) &
T="timeout 130 $PY -m pytest -q -p no:cacheprovider -x"
($T tests/test_cuda_paths.py -k "resample or snis or ode_mlp or vae_elbo or importance_sampling or importance_log_weights or vae_mlp" > $OUT/t_paths.txt 2>&1) &
($T tests/test_resample.py tests/test_snis.py tests/test_importance_sampling_batched.py -k "cuda" > $OUT/t_is.txt 2>&1) &
($T tests/test_ode_mlp.py -k "cuda" > $OUT/t_ode.txt 2>&1) &
($T tests/test_vae_likelihoods.py tests/test_vae_modules.py tests/test_vae_iwae.py tests/test_vae_mlp.py -k "cuda" > $OUT/t_vae.txt 2>&1) &
($T tests/test_contract.py -k "cuda and (resample or snis or ode_mlp or importance_log_weights or vae_mlp)" > $OUT/t_contract.txt 2>&1) &
($T tests/test_integration.py tests/test_serving.py tests/test_examples.py -k "cuda" > $OUT/t_integ.txt 2>&1) &
wait
for f in $OUT/t_*.txt; do echo "$(basename $f): $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" $f | head -5; done
for f in $OUT/racecheck.txt $OUT/memcheck.txt; do tail -n 3 $f; done
