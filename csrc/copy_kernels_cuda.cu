// CUDA kernels of the three copy ops: one launch per (source dtype,
// destination dtype) pair in the op, whatever the number of tensors. The plan
// (copy_plan.h: segments and their tiles) is uploaded in one host-to-device
// copy and kept for the next call with the same tensors (copy_plan_cache.h);
// each block binary-searches its segment and moves one tile with 16-byte
// accesses where alignment allows.

#include "copy_kernels.h"
#include "copy_plan.h"
#include "copy_plan_cache.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <memory>

namespace megatron_fsdp {
namespace {

template <typename S, typename D>
__global__ void __launch_bounds__(kCopyThreads)
    multi_tensor_copy_kernel(const CopySegment* segments, const int64_t* first_tile, int64_t n_segments) {
  const int64_t tile = blockIdx.x;
  const int64_t seg = find_segment(first_tile, n_segments, tile);
  copy_tile<S, D>(segments[seg], tile - first_tile[seg], threadIdx.x, blockDim.x);
}

// A plan on the device: every group's segments and first tiles in one table,
// uploaded once. A cached one is launched again from any stream: `uploaded`
// orders its kernels after the upload, and the table is recorded on that
// stream so the allocator keeps it until they have run.
struct DevicePlan {
  struct Launch {
    CopyKind kind;
    int64_t n_segments;
    int64_t tiles;
    size_t segments_at;    // byte offsets in the table
    size_t first_tile_at;
  };
  std::vector<Launch> launches;
  at::Tensor table;
  cudaStream_t upload_stream = nullptr;
  cudaEvent_t uploaded = nullptr;

  DevicePlan() = default;
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;
  ~DevicePlan() {
    if (uploaded != nullptr) cudaEventDestroy(uploaded);  // safe while pending; no error thrown from here
  }
};

std::shared_ptr<DevicePlan> upload(const CopyPlan& plan, const at::Device& device, cudaStream_t stream) {
  auto dev = std::make_shared<DevicePlan>();
  size_t bytes = 0;
  for (const CopyGroup& group : plan.groups) {
    const int64_t n = static_cast<int64_t>(group.segments.size());
    const int64_t tiles = group.first_tile.back();
    if (tiles == 0) continue;
    const size_t segments_at = bytes;
    bytes += n * sizeof(CopySegment);
    const size_t first_tile_at = bytes;
    bytes += (n + 1) * sizeof(int64_t);
    dev->launches.push_back({group.kind, n, tiles, segments_at, first_tile_at});
  }
  if (dev->launches.empty()) return dev;
  // Pinned, so the upload is asynchronous; the caching host allocator keeps
  // the buffer until the copy on `stream` has finished.
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  char* base = static_cast<char*>(host.data_ptr());
  size_t launch = 0;
  for (const CopyGroup& group : plan.groups) {
    if (group.first_tile.back() == 0) continue;
    const DevicePlan::Launch& l = dev->launches[launch++];
    std::memcpy(base + l.segments_at, group.segments.data(), l.n_segments * sizeof(CopySegment));
    std::memcpy(base + l.first_tile_at, group.first_tile.data(), (l.n_segments + 1) * sizeof(int64_t));
  }
  dev->table = host.to(device, /*non_blocking=*/true);
  dev->upload_stream = stream;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&dev->uploaded, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(dev->uploaded, stream));
  return dev;
}

void launch(const DevicePlan& dev, const c10::cuda::CUDAStream& stream) {
  if (dev.launches.empty()) return;
  if (stream.stream() != dev.upload_stream) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), dev.uploaded, 0));
    dev.table.record_stream(stream.unwrap());
  }
  const char* table = static_cast<const char*>(dev.table.data_ptr());
  for (const DevicePlan::Launch& l : dev.launches) {
    const auto* segments = reinterpret_cast<const CopySegment*>(table + l.segments_at);
    const auto* first_tile = reinterpret_cast<const int64_t*>(table + l.first_tile_at);
    dispatch_copy_kind(l.kind, [&](auto s, auto d) {
      using S = typename decltype(s)::type;
      using D = typename decltype(d)::type;
      multi_tensor_copy_kernel<S, D><<<static_cast<unsigned>(l.tiles), kCopyThreads, 0, stream.stream()>>>(
          segments, first_tile, l.n_segments);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

PlanCache<DevicePlan>& device_plan_cache() {
  static PlanCache<DevicePlan> cache(kPlanCacheCapacity);
  return cache;
}

// A CUDA graph would capture the plan's upload from one host buffer and
// replay it after that buffer is reused: while capturing, ATen's copies run.
bool capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// The plan of `key` from the cache, or made, run and (when the kernels run all
// of it) kept; `make_plan(use_kernel)` checks the arguments and plans.
template <typename MakePlan>
void run_on_device(PlanKey key, const at::Tensor& anchor, MakePlan&& make_plan) {
  const c10::cuda::CUDAGuard guard(anchor.device());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  if (capturing(stream)) {
    make_plan(/*use_kernel=*/false).run_aten_copies();
    return;
  }
  PlanCache<DevicePlan>& cache = device_plan_cache();
  if (const std::shared_ptr<const DevicePlan> cached = cache.find(key)) {
    launch(*cached, stream);
    return;
  }
  const CopyPlan plan = make_plan(/*use_kernel=*/true);
  std::shared_ptr<DevicePlan> dev = upload(plan, anchor.device(), stream.stream());
  launch(*dev, stream);
  plan.run_aten_copies();
  if (cacheable(plan)) cache.insert(std::move(key), std::move(dev));
}

}  // namespace

PlanCacheStats cuda_plan_cache_stats() { return device_plan_cache().stats(); }
void clear_cuda_plan_cache() { device_plan_cache().clear(); }

void pack_into_cuda(at::TensorList inputs, const at::Tensor& out) {
  run_on_device(pack_into_key(inputs, out), out,
                [&](bool use_kernel) { return plan_pack_into(inputs, out, use_kernel); });
}

void split_copy_out_cuda(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  run_on_device(split_copy_out_key(src, split_sizes, out), src,
                [&](bool use_kernel) { return plan_split_copy_out(src, split_sizes, out, use_kernel); });
}

void chunk_cat_cuda(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  run_on_device(chunk_cat_key(tensors, num_chunks, out), out,
                [&](bool use_kernel) { return plan_chunk_cat(tensors, num_chunks, out, use_kernel); });
}

}  // namespace megatron_fsdp
