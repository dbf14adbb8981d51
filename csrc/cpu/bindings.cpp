// pybind11 bindings of the CPU kernels. No libtorch: tensors arrive as data pointers,
// shapes and strides (bik/backends/native.py does the marshalling), so the module builds in seconds
// and does not depend on the torch version. The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "bik/bindings.h"
#include "kernels.h"

namespace py = pybind11;
using bik::MatmulArgs;

namespace {

void matmul(int dtype, uintptr_t a, uintptr_t b, uintptr_t bias, uintptr_t c, int64_t batch,
            int64_t M, int64_t N, int64_t K, int64_t a_batch_stride, int64_t a_row_stride,
            int64_t b_batch_stride, int64_t b_k_stride, int64_t b_n_stride) {
  bik::matmul(dtype, MatmulArgs{a, b, bias, c, batch, M, N, K, a_batch_stride, a_row_stride,
                                b_batch_stride, b_k_stride, b_n_stride});
}

void pack_weight(int dtype, uintptr_t b, uintptr_t dst, int64_t N, int64_t K, int64_t b_k_stride,
                 int64_t b_n_stride) {
  bik::pack_weight(dtype, MatmulArgs{0, b, 0, 0, 1, 0, N, K, 0, 0, 0, b_k_stride, b_n_stride}, dst);
}

void matmul_prepacked(int dtype, uintptr_t a, uintptr_t packed, uintptr_t bias, uintptr_t c,
                      int64_t M, int64_t N, int64_t K, int64_t a_row_stride) {
  bik::matmul_prepacked(dtype, MatmulArgs{a, 0, bias, c, 1, M, N, K, 0, a_row_stride, 0, 0, 0},
                        packed);
}

void chunked_matmul(int dtype, uintptr_t a, uintptr_t b, uintptr_t c, int64_t M, int64_t N,
                    int64_t K, int64_t a_row_stride, int64_t b_k_stride, int64_t b_n_stride,
                    int64_t chunks) {
  bik::chunked_matmul(
      dtype, MatmulArgs{a, b, 0, c, 1, M, N, K, 0, a_row_stride, 0, b_k_stride, b_n_stride},
      chunks);
}

void attention(int dtype, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t kv_start, uintptr_t out,
               std::array<int64_t, 7> sizes, std::array<int64_t, 3> q_strides,
               std::array<int64_t, 3> k_strides, std::array<int64_t, 3> v_strides, float scale,
               bool causal, float softcap, int64_t window, uintptr_t sinks) {
  const auto args = bik::attention_args(q, k, v, kv_start, out, sizes, q_strides, k_strides,
                                        v_strides, scale, causal, softcap, window, sinks);
  bik::attention(dtype, args);
}

void paged_attention(int dtype, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
                     uintptr_t block_table, uintptr_t query_start, uintptr_t seq_lens,
                     uintptr_t out, std::array<int64_t, 8> sizes, std::array<int64_t, 2> q_strides,
                     std::array<int64_t, 3> k_strides, std::array<int64_t, 3> v_strides,
                     float scale, float softcap, int64_t window, uintptr_t sinks) {
  bik::PagedAttentionArgs args{q,
                               k_cache,
                               v_cache,
                               block_table,
                               query_start,
                               seq_lens,
                               out,
                               sizes[0],
                               sizes[1],
                               sizes[2],
                               sizes[3],
                               sizes[4],
                               sizes[5],
                               sizes[6],
                               sizes[7],
                               {q_strides[0], q_strides[1]},
                               {k_strides[0], k_strides[1], k_strides[2]},
                               {v_strides[0], v_strides[1], v_strides[2]},
                               scale,
                               softcap,
                               window,
                               sinks};
  bik::paged_attention(dtype, args);
}

void delta_rule(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t decay, uintptr_t beta,
                uintptr_t state, uintptr_t out, std::array<int64_t, 5> sizes, bool decay_per_key) {
  bik::delta_rule(bik::DeltaRuleArgs{q, k, v, decay, beta, state, out, sizes[0], sizes[1], sizes[2],
                                     sizes[3], sizes[4], decay_per_key});
}

void selective_scan(uintptr_t decay, uintptr_t dtx, uintptr_t b, uintptr_t c, uintptr_t state,
                    uintptr_t out, std::array<int64_t, 6> sizes) {
  bik::selective_scan(bik::SelectiveScanArgs{decay, dtx, b, c, state, out, sizes[0], sizes[1],
                                             sizes[2], sizes[3], sizes[4], sizes[5]});
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "bik's batch-invariant CPU kernels (fixed reduction orders, OpenMP over rows)";
  bik::export_contract(m);
  auto release = py::call_guard<py::gil_scoped_release>();
  m.def("matmul", &matmul, release);
  m.def("packed_weight_bytes", &bik::packed_weight_bytes,
        "bytes of B [K, N] packed by pack_weight (the matmul kernel's layout)");
  m.def("pack_weight", &pack_weight, release,
        "B [K, N] (any strides, e.g. a weight's W^T) packed once at dst");
  m.def("matmul_prepacked", &matmul_prepacked, release,
        "C [M, N] = A [M, K] . B (+ bias) with B packed by pack_weight: matmul's bits");
  m.def("chunked_matmul", &chunked_matmul, release,
        "fp32 C [M, N] = A [M, K] . B [K, N] in K chunks (a power of two dividing K), each in "
        "the fma order on fp32 values, summed by the balanced tree (bik.distributed)");
  m.def("rms_norm", &bik::rms_norm, release);
  m.def("log_softmax", &bik::log_softmax, release);
  m.def("token_logprobs", &bik::token_logprobs, release);
  m.def("attention", &attention, release,
        "sizes = (B, Hq, Hkv, Tq, Tk, D, split_size); strides = (batch, head, position); "
        "softcap 0, window 0 and sinks 0 (fp32 [Hq] logits) mean off");
  m.def("paged_attention", &paged_attention, release,
        "sizes = (T, S, Hq, Hkv, D, block_size, split_size, block_table row stride); strides: "
        "q (token, head), caches (block, head, slot); int32 block_table, query_start, "
        "seq_lens; softcap 0, window 0 and sinks 0 mean off");
  m.def("delta_rule", &delta_rule, release,
        "the gated delta rule on contiguous fp32 tensors; sizes = (B, H, T, K, V); the state "
        "[B, H, K, V] is overwritten by the final one (bik.layers.delta_rule's order)");
  m.def("selective_scan", &selective_scan, release,
        "the Mamba2 scan on contiguous fp32 tensors; sizes = (B, H, T, P, N, heads per group); "
        "the state [B, H, P, N] is overwritten by the final one (bik.layers.mamba2's order)");
}
