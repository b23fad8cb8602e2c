#!/usr/bin/env bash
# Everything that needs a real GPU, in one call (the lent GPU machine: torch, JAX, CuPy, numba
# and numba-cuda preinstalled, no registry). Run from the repository root:
#     bash benchmarks/gpu_session.sh            # logs and JSON under ${OUT:-gpu-out}/
# 1. installs srround in place without dependencies, 2. runs the whole test suite on the real
# GPU (tests/conftest.py uses the GPU when /dev/nvidiactl exists, so CUDA tests are not
# simulated), 3. runs every benchmark for the GPU, each against its same-run baselines, with
# --json into benchmarks/results/<name>_gpu.json (copied to $out/results/), 4. regenerates
# benchmarks/RESULTS.md (copied to $out/), 5. runs the language-model demo's GPU configuration
# (srround demo --device cuda).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$out/gpu.txt"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python -c "import numpy, numba, numba_cuda; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__)" | tee -a "$out/gpu.txt"
python -m pytest -q -x -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | tail -30
mkdir -p "$out/results" benchmarks/results
for script in benchmarks/bench_*.py; do
    name=$(basename "$script" .py)
    args=(--json "benchmarks/results/${name}_gpu.json")
    case "$name" in
        bench_audit | bench_compile) ;;  # CPU only
        *) args+=(--device cuda) ;;
    esac
    python "$script" "${args[@]}" 2>&1 | tee "$out/$name.log" | tail -40
    cp -f "benchmarks/results/${name}_gpu.json" "$out/results/" 2>/dev/null || true
done
# the torch.compile rows on the GPU (compiled step srround vs torch fused AdamW, compile time);
# the CUDA-graph capture test runs in the pytest call above (tests/test_torch_compile.py)
python benchmarks/bench_optim.py --device cuda --sections compile \
    --json benchmarks/results/bench_optim_compile_gpu.json 2>&1 | tee "$out/bench_optim_compile.log" | tail -12
cp -f benchmarks/results/bench_optim_compile_gpu.json "$out/results/" 2>/dev/null || true
python benchmarks/results.py && cp -f benchmarks/RESULTS.md "$out/"
# the lm demo's GPU configuration (a larger transformer, bf16 activations): table and PNG
python -m srround demo --device cuda --out "$out" 2>&1 | tee "$out/demo_lm.log" | tail -12
# the JAX native path on the GPU: stochastic_round and the fused step vs copy bandwidth, and its
# bits against the Numba CUDA kernels (JAX must see the GPU: a CUDA jaxlib)
python benchmarks/jax_gpu_check.py --json "$out/jax_gpu_check.json" 2>&1 | tee "$out/jax_gpu_check.log" | tail -12
# FSDP2 / DDP / ZeRO with srround (tests/test_torch_dist.py) run on CPU with gloo in the pytest
# call above, and on the GPU over a 1-rank NCCL group (test_fsdp2_on_cuda_one_rank_matches_plain:
# DTensor pieces on CUDA, eager and compiled step, found_inf all-reduced); compile on CUDA:
# test_torch_compile.py::test_compiled_step_on_cuda_matches_eager_bits. 2-rank NCCL needs 2 GPUs
# (not on a 1-GPU machine): the FSDP2 row on CPU for the record (2 gloo processes, srround vs
# torch fused AdamW)
python benchmarks/bench_optim.py --device cpu --sections dist \
    --json benchmarks/results/bench_optim_dist.json 2>&1 | tee "$out/bench_optim_dist.log" | tail -10
