#!/usr/bin/env bash
# Olmo-core 3's expert-parallel benchmark (the peer kit's bench_olmo_ep.py) on this machine,
# to run beside ours in the same session (issue 21):
#   benchmarks/peer_ep.sh KIT_DIR WHEELS_DIR NPROC sync_1d|rowwise_nvshmem OUT.json
# KIT_DIR holds bench_olmo_ep.py and fast_te_shim.py; WHEELS_DIR the wheels its wheels.txt names.
# The environment is the kit README's; NVLink multicast stays off.
set -euo pipefail
kit=$1 wheels=$2 nproc=$3 path=$4 out=$5
case $path in sync_1d | rowwise_nvshmem) ;; *)
  echo "path=$path is not allowed: sync_1d or rowwise_nvshmem." >&2
  exit 2
  ;;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$kit:${PYTHONPATH:-}"
if [ "$path" = rowwise_nvshmem ]; then
  export OLMO_USE_OWN_SYMM_MEM=1 NVSHMEM_SYMMETRIC_SIZE=25769803776
  export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_REMOTE_TRANSPORT=none
  lib=$(python3 -c "import nvidia.nvshmem as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  TORCH_CUDA_ARCH_LIST=9.0 python3 -m olmo_core.kernels.build_symm_mem_vdev2d_ext --inplace --backend cmake
fi
python3 -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$kit/bench_olmo_ep.py" \
  --path "$path" --mbs 4 --compile 1 --out "$out"
