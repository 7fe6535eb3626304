#!/usr/bin/env bash
# One GPU pass of issue 16 on a machine with one CUDA GPU and torch, the project's other packages
# importable (hivemind not needed): the CUDA tests, benchmarks/gpu.py (profile vs run, memory split,
# scaling bands, fit search) and the instrumentation overhead on cuda. Limits in seconds:
# TESTS_S, GPU_CHECK_S, OVERHEAD_S; OVERHEAD_WORKLOADS (space-separated), OVERHEAD_WINDOW_S,
# OVERHEAD_REPEATS (pairs; 7 give a 98 % interval of the median pair, overhead.py's verdict),
# TRAIN_SIZE (samples of the synthetic CIFAR-10; ImageNet's is 1,024).
#
#   OUT=/some/folder bash benchmarks/gpu_pass.sh [extra arguments of benchmarks/gpu.py]
#
# Writes under $OUT (default benchmarks/results): log.txt, overhead-cuda.json, gpu.json and
# profiles.tar.gz (this GPU's profiles, for a GPU -> GPU band on another kind: --from-profiles).
# Render them into docs/validation.md on any machine with
#   python benchmarks/overhead.py --docs-from overhead-cuda.json; python benchmarks/gpu.py --docs-from gpu.json
set -u
OUT=$(realpath -m "${OUT:-benchmarks/results}")
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DDLSCOPE_DATA=${DDLSCOPE_DATA:-/tmp/ddlscope-gpu-data}
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m ddlscope data synthetic cifar10 --train-size "${TRAIN_SIZE:-4096}" --test-size 32 >/dev/null
python3 -m ddlscope data synthetic imagenet --train-size 1024 --test-size 32 >/dev/null
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_device.py tests/test_timeline.py \
  tests/test_memory_split.py tests/test_profile_fit.py tests/test_gpu_scaling.py tests/test_preflight.py
echo "pytest exit: $?"
# gpu.py before the overhead: its profiles are what a pass on a second GPU kind needs (--from-profiles)
(cd benchmarks && timeout "${GPU_CHECK_S:-300}" python3 gpu.py --out "$OUT/gpu.json" --profiles-out /tmp/gpu-profiles \
  --no-docs "$@")
echo "gpu.py exit: $?"
tar -czf "$OUT/profiles.tar.gz" -C /tmp gpu-profiles 2>/dev/null
# overhead.py saves after every workload, so a pass cut by OVERHEAD_S keeps the workloads it finished
read -r -a workloads <<< "${OVERHEAD_WORKLOADS:-vgg11:cifar10:64 mobilenet_v2:cifar10:64 resnet18:cifar10:256 resnet50:imagenet:64}"
(cd benchmarks && timeout "${OVERHEAD_S:-240}" python3 overhead.py --device cuda "${workloads[@]/#/--workload=}" \
  --min-window-s "${OVERHEAD_WINDOW_S:-3}" --repeats "${OVERHEAD_REPEATS:-7}" --out "$OUT/overhead-cuda.json" --no-docs)
echo "overhead exit: $?"
