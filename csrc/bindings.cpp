// The extension's entry points: the `megatron_fsdp::` ops, our kernels as
// implementations of FSDP2's `fsdp::` copy ops (installed and removed at run
// time), and the Python module.

#include "copy_kernels.h"
#include "copy_plan_cache.h"
#include "crc32c.h"
#include "fp8_kernels.h"

#include <ATen/record_function.h>
// torch/python.h, not torch/extension.h: the pybind11 bindings without the whole C++
// frontend (torch/all.h), which doubled this file's compile time.
#include <torch/python.h>
#include <torch/library.h>

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

at::Tensor multi_tensor_amax(at::TensorList tensors) {
#ifdef MEGATRON_FSDP_WITH_CUDA
  if (!tensors.empty() && tensors[0].is_cuda()) return multi_tensor_amax_cuda(tensors);
#endif
  return multi_tensor_amax_cpu(tensors);
}

// Bytes-like objects in, the GIL released while long buffers are read.
template <uint32_t (*Crc)(uint32_t, const void*, size_t)>
uint32_t crc32c_of_buffer(const pybind11::object& data, const pybind11::object& value) {
  namespace py = pybind11;
  if (!PyLong_Check(value.ptr())) {
    throw py::type_error("crc32c: value must be an int, got " + std::string(Py_TYPE(value.ptr())->tp_name));
  }
  int overflow = 0;
  const long long start = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0 || start < 0 || start > 0xFFFFFFFFLL) {
    throw py::value_error("crc32c: value must be in [0, 2**32), got " + std::string(py::str(value)));
  }
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  uint32_t crc;
  if (view.len < (1 << 16)) {
    crc = Crc(static_cast<uint32_t>(start), view.buf, static_cast<size_t>(view.len));
  } else {
    py::gil_scoped_release nogil;
    crc = Crc(static_cast<uint32_t>(start), view.buf, static_cast<size_t>(view.len));
  }
  PyBuffer_Release(&view);
  return crc;
}

// ---- FSDP2's fsdp:: copy ops (schemas in megatron_fsdp/kernels/fsdp_copy_ops.py) ----

// Where our kernels serve an fsdp:: op, the profiler shows a
// "megatron_fsdp::<op>" range inside torch's "fsdp::<op>" (torch.profiler,
// chrome traces): which kernel ran, and its time. Free when not profiling.
std::tuple<at::Tensor, at::Tensor> fsdp_all_gather_copy_in(at::TensorList all_gather_inputs,
                                                           const at::Tensor& all_gather_output,
                                                           c10::SymIntArrayRef inp_split_sizes,
                                                           c10::SymInt all_gather_input_numel, c10::SymInt rank) {
  RECORD_FUNCTION("megatron_fsdp::all_gather_copy_in", std::vector<c10::IValue>());
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
  RECORD_FUNCTION("megatron_fsdp::split_with_sizes_copy", std::vector<c10::IValue>());
  split_copy_out(all_gather_output, sizes, out);
}

void fsdp_chunk_cat(at::TensorList tensors, int64_t dim, int64_t num_chunks, const at::Tensor& out) {
  bool ours = dim == 0 && out.dim() == 2 && out.is_contiguous() && !tensors.empty();
  for (const at::Tensor& t : tensors) ours = ours && t.scalar_type() == tensors[0].scalar_type();
  if (!ours) {
    at::Tensor result = out;  // torch's op takes a mutable handle; same tensor
    at::_chunk_cat_out(result, tensors, dim, num_chunks);
    return;
  }
  RECORD_FUNCTION("megatron_fsdp::chunk_cat", std::vector<c10::IValue>());
  chunk_cat(tensors, num_chunks, out);
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
  m.def("multi_tensor_amax(Tensor[] tensors) -> Tensor");
  m.def("cast_to_fp8(Tensor src, Tensor scale, ScalarType dtype, Tensor(a!) out) -> ()");
  m.def("cast_transpose_to_fp8(Tensor src, Tensor scale, ScalarType dtype, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) amax) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_fsdp, CPU, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cpu);
  m.impl("split_copy_out", &megatron_fsdp::split_copy_out_cpu);
  m.impl("chunk_cat", &megatron_fsdp::chunk_cat_cpu);
  m.impl("multi_tensor_amax", &megatron_fsdp::multi_tensor_amax_cpu);
  m.impl("cast_to_fp8", &megatron_fsdp::cast_to_fp8_cpu);
  m.impl("cast_transpose_to_fp8", &megatron_fsdp::cast_transpose_to_fp8_cpu);
}

// None of these ops is differentiable (an amax, byte casts): autograd passes them
// by, so weights that require grad give outputs that do not.
TORCH_LIBRARY_IMPL(megatron_fsdp, Autograd, m) {
  m.impl("multi_tensor_amax", torch::CppFunction::makeFallthrough());
  m.impl("cast_to_fp8", torch::CppFunction::makeFallthrough());
  m.impl("cast_transpose_to_fp8", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(megatron_fsdp, Meta, m) {
  m.impl("multi_tensor_amax", &megatron_fsdp::multi_tensor_amax_meta);
  m.impl("cast_to_fp8", &megatron_fsdp::check_cast_to_fp8_args);
  m.impl("cast_transpose_to_fp8", &megatron_fsdp::check_cast_transpose_to_fp8_args);
}

#ifdef MEGATRON_FSDP_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("pack_into", &megatron_fsdp::pack_into_cuda);
  m.impl("split_copy_out", &megatron_fsdp::split_copy_out_cuda);
  m.impl("chunk_cat", &megatron_fsdp::chunk_cat_cuda);
  m.impl("multi_tensor_amax", &megatron_fsdp::multi_tensor_amax_cuda);
  m.impl("cast_to_fp8", &megatron_fsdp::cast_to_fp8_cuda);
  m.impl("cast_transpose_to_fp8", &megatron_fsdp::cast_transpose_to_fp8_cuda);
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
  m.def("copy_plan_cache_stats", [] {
    py::dict out;
    for (const auto& [name, s] : copy_plan_cache_stats()) {
      py::dict d;
      d["hits"] = s.hits;
      d["misses"] = s.misses;
      d["entries"] = s.entries;
      d["capacity"] = s.capacity;
      out[py::str(name)] = d;
    }
    return out;
  }, "Hits, misses, entries and capacity of the copy ops' plan caches, by name (emulated, cuda)");
  m.def("clear_copy_plan_caches", &clear_copy_plan_caches, "Forget every kept copy plan and zero the counts");
  m.def("install_fsdp_kernels", &install_fsdp_kernels,
        "Register our kernels for fsdp::all_gather_copy_in, split_with_sizes_copy and chunk_cat");
  m.def("uninstall_fsdp_kernels", &uninstall_fsdp_kernels, "Remove them: torch's kernels serve again");

  m.def("multi_tensor_amax", [](const std::vector<at::Tensor>& tensors) { return multi_tensor_amax(tensors); },
        nogil);
  m.def("multi_tensor_amax_emulated",
        [](const std::vector<at::Tensor>& tensors) { return multi_tensor_amax_emulated(tensors); }, nogil);

  m.def("crc32c", &crc32c_of_buffer<crc32c>, py::arg("data"), py::arg("value") = 0,
        "CRC-32C of a bytes-like object (C-contiguous buffer), continued from `value` like zlib.crc32");
  m.def("crc32c_portable", &crc32c_of_buffer<crc32c_portable>, py::arg("data"), py::arg("value") = 0,
        "crc32c with lookup tables only: what CPUs without SSE4.2 run");
  m.def("crc32c_uses_hardware", &crc32c_uses_hardware);
}
