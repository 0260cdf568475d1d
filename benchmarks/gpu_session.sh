#!/usr/bin/env bash
# The first minutes on a lent GPU, as one prepared command (docs/PERFORMANCE.md, "GPU").
#
#   bash benchmarks/gpu_session.sh --download   # here, with PyPI: the wheels the GPU image lacks -> .gpu_wheels/
#   bash benchmarks/gpu_session.sh              # there (no network): install them, then measure into $OUT
#
# The GPU image has Python 3.12, jax 0.11 (CUDA), flax 0.12.10, optax, orbax, tensorstore and
# torch, and no network. The project runs from PYTHONPATH (no `pip install -e`, which could pull
# other versions of jax or flax); the wheels of the rest of its runtime (ml_collections,
# tensorboardX, jmp, tokenizers, ...) and of pytest travel in .gpu_wheels/ (ignored by git:
# carry it), and pip installs only what the image does not already have.
#
# There, in order, each step's output in $OUT (default ./gpu_out):
#   env.txt          nvidia-smi, versions
#   repro.txt        benchmarks/repro_nested_shard_map.py (jax 0.11's abort on nested maps)
#   tests.txt        the tests that only a GPU runs (unrolled remat memory) and the pipelined
#                    data-local step compiled on jax 0.11 (JAX_PLATFORMS empty: the GPU is the default)
#   gpu_check.json   benchmarks/gpu_check.py, its Markdown table in gpu_check.md; among its rows the
#                    single-GPU grouped GEMM (benchmarks/grouped_gemm.py: jax.lax.ragged_dot at moe_1t's
#                    expert shape, one device's share at EP 32, beside a dense matmul of the same FLOPs)
# GPU_CHECK_BUDGET_S (default 330) bounds gpu_check; the whole script fits the device tool's
# 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels
PACKAGES=(ml_collections tensorboardX jmp tokenizers safetensors tqdm absl-py pytest pytest-xdist transformers)

if [[ "${1:-}" == "--download" ]]; then
  pip download -q --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" "${PACKAGES[@]}"
  rm -f "$WHEELS"/numpy-*.whl  # the image's jax brings its numpy (16 MB less to carry)
  du -sh "$WHEELS"
  exit 0
fi

OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; nvidia-smi || rocm-smi || true
  python -c 'import sys, jax; print(sys.version); print(jax.__version__, jax.devices())'
} > "$OUT/env.txt" 2>&1
if [[ -d "$WHEELS" ]]; then
  pip install -q --no-index --find-links "$WHEELS" "${PACKAGES[@]}" >> "$OUT/env.txt" 2>&1
fi
python -c 'import jaxfrontier.run.loop, ml_collections, jmp' >> "$OUT/env.txt" 2>&1 ||
  { echo "the project does not import: see $OUT/env.txt"; tail -5 "$OUT/env.txt"; exit 1; }

# PEERS=1: jaxfrontier against torch.compile on the GPU shapes (benchmarks/peers.py, issue 38) in
# peers.md/peers.json; a second call of the device tool (each size compiles for minutes). The Llama
# rows use transformers, whose wheel and dependencies --download packs (33 MB in all, 2026-12-04;
# everything resolves from $WHEELS but numpy, which the image has): PEERS_SIZES=gpt1.3b,llama1b,llama8b_4l.
if [[ "${PEERS:-0}" == "1" ]]; then
  timeout "${PEERS_BUDGET_S:-540}" python benchmarks/peers.py --sizes "${PEERS_SIZES:-gpt1.3b}" --families gpt,llama \
    --peers jf,torch_compile --rounds 3 --steps 3 --out "$OUT/peers.json" > "$OUT/peers.md" 2> "$OUT/peers.err"
  echo "peers exit $?" >> "$OUT/peers.md"; tail -12 "$OUT/peers.md"
  exit 0
fi

timeout 120 python benchmarks/repro_nested_shard_map.py > "$OUT/repro.txt" 2>&1
echo "repro exit $?" >> "$OUT/repro.txt"

JAX_PLATFORMS= timeout 240 python -m pytest -q -n 0 -p no:cacheprovider \
  tests/model/test_attention.py::test_unrolled_remat_full_saves_memory \
  tests/test_parallel.py::test_pipelined_gradients_cross_data_once_per_step > "$OUT/tests.txt" 2>&1
echo "tests exit $?" >> "$OUT/tests.txt"

# GPU_CHECK_ARGS=--quick rehearses the whole script on a CPU (a Python 3.12 venv with only the image's packages)
python benchmarks/gpu_check.py --out="$OUT/gpu_check.json" --budget_s="${GPU_CHECK_BUDGET_S:-330}" ${GPU_CHECK_ARGS:-} \
  > "$OUT/gpu_check.md" 2> "$OUT/gpu_check.err"
echo "gpu_check exit $?" >> "$OUT/gpu_check.md"
tail -40 "$OUT/gpu_check.md"; tail -n 3 "$OUT"/repro.txt "$OUT"/tests.txt
