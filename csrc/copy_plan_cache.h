// Copy plans kept between calls. FSDP2 calls the copy ops with the same
// tensors every step (the sharded parameters, and buffers the caching
// allocator hands out at the same addresses), and planning thousands of small
// tensors costs far more host time than their copy. A plan is a pure function
// of its arguments' addresses, dtypes, devices, sizes and strides, never of
// their values: a call whose key equals an earlier one's reuses that plan
// (the argument checks, which read the same metadata, passed then) and only
// builds the key, a few words per tensor.
#pragma once

#include "copy_plan.h"

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace megatron_fsdp {

enum class CopyOp : int64_t { kPackInto = 1, kSplitCopyOut = 2, kChunkCat = 3 };

// Everything a plan depends on, as words; equal keys give equal plans.
class PlanKey {
 public:
  explicit PlanKey(CopyOp op) { push(static_cast<int64_t>(op)); }

  void add(const at::Tensor& t) {
    push(reinterpret_cast<int64_t>(t.data_ptr()));
    push(static_cast<int64_t>(t.scalar_type()));
    push(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    push(t.dim() * 4 + (t.is_conj() ? 1 : 0) + (t.is_neg() ? 2 : 0));
    for (int64_t d = 0; d < t.dim(); ++d) {
      push(t.size(d));
      push(t.stride(d));
    }
  }
  void add(at::TensorList tensors) {
    push(static_cast<int64_t>(tensors.size()));
    for (const at::Tensor& t : tensors) add(t);
  }
  void add(at::IntArrayRef values) {
    push(static_cast<int64_t>(values.size()));
    for (int64_t v : values) push(v);
  }
  void add(int64_t value) { push(value); }

  uint64_t hash() const { return hash_; }
  bool operator==(const PlanKey& other) const { return hash_ == other.hash_ && words_ == other.words_; }

 private:
  void push(int64_t word) {
    words_.push_back(word);
    hash_ = (hash_ ^ static_cast<uint64_t>(word)) * 1099511628211ULL;  // FNV-1a over words
  }
  std::vector<int64_t> words_;
  uint64_t hash_ = 14695981039346656037ULL;
};

// The keys of the three ops' plans: the same for the CUDA ops and their host emulation.
inline PlanKey pack_into_key(at::TensorList inputs, const at::Tensor& out) {
  PlanKey key(CopyOp::kPackInto);
  key.add(inputs);
  key.add(out);
  return key;
}

inline PlanKey split_copy_out_key(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
  PlanKey key(CopyOp::kSplitCopyOut);
  key.add(src);
  key.add(split_sizes);
  key.add(out);
  return key;
}

inline PlanKey chunk_cat_key(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
  PlanKey key(CopyOp::kChunkCat);
  key.add(tensors);
  key.add(num_chunks);
  key.add(out);
  return key;
}

struct PlanCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t entries = 0;
  int64_t capacity = 0;
};

// The most recently used plans, up to `capacity`; thread-safe (backward's
// reduce-scatter copies may run on autograd's device thread). Values are
// shared, so one evicted while a caller still uses it lives until that ends.
template <typename Value>
class PlanCache {
 public:
  explicit PlanCache(size_t capacity) : capacity_(capacity) {}

  std::shared_ptr<const Value> find(const PlanKey& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(key.hash());
    if (it == index_.end() || !(it->second->first == key)) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    entries_.splice(entries_.begin(), entries_, it->second);
    return it->second->second;
  }

  void insert(PlanKey key, std::shared_ptr<const Value> value) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t hash = key.hash();
    const auto it = index_.find(hash);
    if (it != index_.end()) entries_.erase(it->second);  // the same key planned twice, or a hash collision
    entries_.emplace_front(std::move(key), std::move(value));
    index_[hash] = entries_.begin();
    while (entries_.size() > capacity_) {
      index_.erase(entries_.back().first.hash());
      entries_.pop_back();
    }
  }

  PlanCacheStats stats() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return PlanCacheStats{hits_, misses_, static_cast<int64_t>(entries_.size()), static_cast<int64_t>(capacity_)};
  }

  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    index_.clear();
    entries_.clear();
    hits_ = misses_ = 0;
  }

 private:
  using Entry = std::pair<PlanKey, std::shared_ptr<const Value>>;
  const size_t capacity_;
  std::mutex mutex_;
  std::list<Entry> entries_;  // most recently used first
  std::unordered_map<uint64_t, typename std::list<Entry>::iterator> index_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// Plans kept per cache: FSDP2 makes a few calls per unit and step (copy-in,
// copy-out, the gradients' chunk_cat), and a model has tens to hundreds of units.
constexpr size_t kPlanCacheCapacity = 512;

// A plan is kept only when the kernels run all of it: ATen's copies hold tensor views.
inline bool cacheable(const CopyPlan& plan) { return plan.aten_copies.empty() && plan.aten_zeros.empty(); }

// The caches' statistics and reset, by name ("emulated": the host runs of the
// device plans; "cuda": the device's, when built with CUDA).
std::vector<std::pair<std::string, PlanCacheStats>> copy_plan_cache_stats();
void clear_copy_plan_caches();

// The host-run plans (copy_plan.cpp).
PlanCache<CopyPlan>& emulated_plan_cache();
#ifdef MEGATRON_FSDP_WITH_CUDA
PlanCacheStats cuda_plan_cache_stats();
void clear_cuda_plan_cache();
#endif

}  // namespace megatron_fsdp
