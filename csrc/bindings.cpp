// The extension's entry points: the `megatron_fsdp::` ops, our kernels as
// implementations of FSDP2's `fsdp::` copy ops (installed and removed at run
// time), and the Python module.

#include "copy_kernels.h"

#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

namespace megatron_fsdp {
namespace {

// ---- device dispatch of the kernels ----

void pack_into(at::TensorList inputs, const at::Tensor& out) {
#ifdef MEGATRON_FSDP_WITH_CUDA
  if (out.is_cuda()) return pack_into_cuda(inputs, out);
#endif
  pack_into_cpu(inputs, out);
}

void split_copy_out(const at::Tensor& src, at::IntArrayRef split_sizes, at::TensorList out) {
#ifdef MEGATRON_FSDP_WITH_CUDA
  if (src.is_cuda()) return split_copy_out_cuda(src, split_sizes, out);
#endif
  split_copy_out_cpu(src, split_sizes, out);
}

void chunk_cat(at::TensorList tensors, int64_t num_chunks, const at::Tensor& out) {
#ifdef MEGATRON_FSDP_WITH_CUDA
  if (out.is_cuda()) return chunk_cat_cuda(tensors, num_chunks, out);
#endif
  chunk_cat_cpu(tensors, num_chunks, out);
}

// ---- FSDP2's fsdp:: copy ops (schemas in megatron_fsdp/kernels/fsdp_copy_ops.py) ----

// How often each kernel served an fsdp:: op: lets tests and users see them run.
std::atomic<int64_t> g_all_gather_copy_in_calls{0}, g_split_with_sizes_copy_calls{0}, g_chunk_cat_calls{0};

std::tuple<at::Tensor, at::Tensor> fsdp_all_gather_copy_in(at::TensorList all_gather_inputs,
                                                           const at::Tensor& all_gather_output,
                                                           c10::SymIntArrayRef inp_split_sizes,
                                                           c10::SymInt all_gather_input_numel, c10::SymInt rank) {
  const int64_t numel = all_gather_input_numel.expect_int();
  TORCH_CHECK(inp_split_sizes.size() == all_gather_inputs.size(), "all_gather_copy_in: ", all_gather_inputs.size(),
              " inputs but ", inp_split_sizes.size(), " split sizes");
  int64_t split_total = 0;
  for (size_t i = 0; i < all_gather_inputs.size(); ++i) {
    TORCH_CHECK(inp_split_sizes[i].expect_int() == all_gather_inputs[i].numel(), "all_gather_copy_in: input ", i,
                " has ", all_gather_inputs[i].numel(), " elements but its split size is ", inp_split_sizes[i]);
    split_total += all_gather_inputs[i].numel();
  }
  TORCH_CHECK(split_total == numel, "all_gather_copy_in: the split sizes add up to ", split_total,
              " but all_gather_input_numel is ", numel);
  at::Tensor all_gather_input = all_gather_output.narrow(0, numel * rank.expect_int(), numel);
  pack_into(all_gather_inputs, all_gather_input);
  ++g_all_gather_copy_in_calls;
  return {all_gather_input, all_gather_output};
}

void fsdp_split_with_sizes_copy(const at::Tensor& all_gather_output, c10::SymIntArrayRef split_sizes, int64_t dim,
                                at::TensorList out) {
  const std::vector<int64_t> sizes = C10_AS_INTARRAYREF_SLOW(split_sizes).vec();
  bool ours = dim == 1 && all_gather_output.dim() == 2 && all_gather_output.is_contiguous();
  for (const at::Tensor& o : out) ours = ours && o.scalar_type() == all_gather_output.scalar_type();
  if (!ours) {
    // FSDP2 always splits a contiguous [world_size, n] buffer along dim 1; anything else gets torch's op, and its errors.
    at::split_with_sizes_copy_out(out, all_gather_output, sizes, dim);
    return;
  }
  split_copy_out(all_gather_output, sizes, out);
  ++g_split_with_sizes_copy_calls;
}

void fsdp_chunk_cat(at::TensorList tensors, int64_t dim, int64_t num_chunks, const at::Tensor& out) {
  bool ours = dim == 0 && out.dim() == 2 && out.is_contiguous() && !tensors.empty();
  for (const at::Tensor& t : tensors) ours = ours && t.scalar_type() == tensors[0].scalar_type();
  if (!ours) {
    at::Tensor result = out;  // torch's op takes a mutable handle; same tensor
    at::_chunk_cat_out(result, tensors, dim, num_chunks);
    return;
  }
  chunk_cat(tensors, num_chunks, out);
  ++g_chunk_cat_calls;
}

// Registering over torch's kernels makes the dispatcher warn about the
// override; that override is the point, so only that warning is dropped.
// (torch warns about overrides once per process, so a later override by
// other code goes unreported: the price of not warning every user here.)
class DropOverrideWarning : public c10::WarningHandler {
 public:
  explicit DropOverrideWarning(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

std::mutex g_fsdp_mutex;
// Never destroyed: at exit the dispatcher may already be gone, and the
// registrations die with the process anyway.
auto* const g_fsdp_libraries = new std::vector<std::unique_ptr<torch::Library>>();

void install_fsdp_kernels() {
  std::lock_guard<std::mutex> lock(g_fsdp_mutex);
  if (!g_fsdp_libraries->empty()) return;
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  const c10::WarningUtils::WarningHandlerGuard guard(&filter);
  std::vector<c10::DispatchKey> keys = {c10::DispatchKey::CPU};
#ifdef MEGATRON_FSDP_WITH_CUDA
  keys.push_back(c10::DispatchKey::CUDA);
#endif
  for (c10::DispatchKey key : keys) {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "fsdp", key, __FILE__, __LINE__);
    library->impl("all_gather_copy_in", TORCH_FN(fsdp_all_gather_copy_in));
    library->impl("split_with_sizes_copy", TORCH_FN(fsdp_split_with_sizes_copy));
    library->impl("chunk_cat", TORCH_FN(fsdp_chunk_cat));
    g_fsdp_libraries->push_back(std::move(library));
  }
}

void uninstall_fsdp_kernels() {
  std::lock_guard<std::mutex> lock(g_fsdp_mutex);
  g_fsdp_libraries->clear();  // the registrations go with their Library; torch's kernels serve again
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY(megatron_fsdp, m) {
  m.def("pack_into(Tensor[] inputs, Tensor(a!) out) -> ()");
  m.def("split_copy_out(Tensor src, int[] split_sizes, Tensor(a!)[] out) -> ()");
  m.def("chunk_cat(Tensor[] tensors, int num_chunks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cpu);
  m.impl("split_copy_out", &megatron_fsdp::split_copy_out_cpu);
  m.impl("chunk_cat", &megatron_fsdp::chunk_cat_cpu);
}

#ifdef MEGATRON_FSDP_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cuda);
  m.impl("split_copy_out", &megatron_fsdp::split_copy_out_cuda);
  m.impl("chunk_cat", &megatron_fsdp::chunk_cat_cuda);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace megatron_fsdp;
  m.attr("has_cuda") = py::bool_(
#ifdef MEGATRON_FSDP_WITH_CUDA
      true
#else
      false
#endif
  );
  // Direct entry points: for thousands of small tensors, the boxed
  // dispatcher's per-tensor cost (list to IValues) outweighs the copies.
  // They record no autograd and release the GIL while they copy.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack_into", [](const std::vector<at::Tensor>& inputs, const at::Tensor& out) { pack_into(inputs, out); },
        nogil);
  m.def("split_copy_out", [](const at::Tensor& src, const std::vector<int64_t>& sizes,
                             const std::vector<at::Tensor>& out) { split_copy_out(src, sizes, out); }, nogil);
  m.def("chunk_cat", [](const std::vector<at::Tensor>& tensors, int64_t num_chunks, const at::Tensor& out) {
    chunk_cat(tensors, num_chunks, out);
  }, nogil);
  // The CUDA kernels' plans run on the host (tests without a GPU).
  m.def("pack_into_emulated", [](const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
    pack_into_emulated(inputs, out);
  }, nogil);
  m.def("split_copy_out_emulated", [](const at::Tensor& src, const std::vector<int64_t>& sizes,
                                      const std::vector<at::Tensor>& out) { split_copy_out_emulated(src, sizes, out); },
        nogil);
  m.def("chunk_cat_emulated", [](const std::vector<at::Tensor>& tensors, int64_t num_chunks, const at::Tensor& out) {
    chunk_cat_emulated(tensors, num_chunks, out);
  }, nogil);
  m.def("install_fsdp_kernels", &install_fsdp_kernels,
        "Register our kernels for fsdp::all_gather_copy_in, split_with_sizes_copy and chunk_cat");
  m.def("uninstall_fsdp_kernels", &uninstall_fsdp_kernels, "Remove them: torch's kernels serve again");
  m.def("fsdp_kernel_calls", []() {
    py::dict calls;
    calls["all_gather_copy_in"] = g_all_gather_copy_in_calls.load();
    calls["split_with_sizes_copy"] = g_split_with_sizes_copy_calls.load();
    calls["chunk_cat"] = g_chunk_cat_calls.load();
    return calls;
  });
}
