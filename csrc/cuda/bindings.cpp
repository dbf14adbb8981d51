// pybind11 bindings of the CUDA kernels (no libtorch: pointers, sizes, strides and the CUDA
// stream arrive as integers; bik/backends/cuda.py marshals them). The GIL is released during
// launches.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "bik/bindings.h"
#include "kernels.h"

namespace py = pybind11;

namespace {

void matmul(int dtype, uintptr_t a, uintptr_t b, uintptr_t bias, uintptr_t c, int64_t batch,
            int64_t M, int64_t N, int64_t K, int64_t a_batch_stride, int64_t a_row_stride,
            int64_t b_batch_stride, int64_t b_k_stride, int64_t b_n_stride, uintptr_t stream) {
  bik_cuda::matmul(dtype,
                   bik::MatmulArgs{a, b, bias, c, batch, M, N, K, a_batch_stride, a_row_stride,
                                   b_batch_stride, b_k_stride, b_n_stride},
                   stream);
}

void attention(int dtype, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t kv_start, uintptr_t out,
               std::array<int64_t, 7> sizes, std::array<int64_t, 3> q_strides,
               std::array<int64_t, 3> k_strides, std::array<int64_t, 3> v_strides, float scale,
               bool causal, float softcap, int64_t window, uintptr_t scratch, int64_t n_splits,
               uintptr_t stream) {
  const auto args = bik::attention_args(q, k, v, kv_start, out, sizes, q_strides, k_strides,
                                        v_strides, scale, causal, softcap, window);
  bik_cuda::attention(dtype, args, scratch, n_splits, stream);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "bik's batch-invariant CUDA kernels (fixed reduction orders, one block per row)";
  bik::export_contract(m);
  auto release = py::call_guard<py::gil_scoped_release>();
  m.def("matmul", &matmul, release);
  m.def("rms_norm", &bik_cuda::rms_norm, release);
  m.def("log_softmax", &bik_cuda::log_softmax, release);
  m.def("token_logprobs", &bik_cuda::token_logprobs, release);
  m.def("attention", &attention, release);
}
