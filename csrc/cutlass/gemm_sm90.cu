// A CUTLASS 3.x GEMM for Hopper (sm_90a) in one fixed order, built as a torch-independent
// shared library (make cutlass-sm90) that a GPU machine loads with ctypes
// (bik/testing/cutlass_sm90.py).
//
// out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), bf16 in and out, fp32 accumulate:
// nn.Linear's layout, row-major x, weight and out. CUTLASS computes the transposed product,
// out^T [N, M] = weight [N, K] @ x^T [K, M], as the Triton backend's linear kernel does
// (bik/backends/triton/matmul.py): output features on the MMA's M side (64 per warpgroup),
// tokens on its N side, so each instruction has the operands of the Triton bucket
// TokenBucket(None, 256, 8, 3, 128), whose bits it can then be compared with on a GPU.
//
// Why a row's bits cannot depend on M: one kernel, one tile shape (128 features x 256 tokens x
// 64) and one instruction (HGMMA 64x256x16, fp32 accumulators) for every M. Each output element is
// accumulated over K in ascending 64-wide k-tiles, each by four 16-wide MMA steps in order,
// into one fp32 accumulator from zero: no split-K and no stream-K (the persistent scheduler
// only decides which SM runs which output tile, never how a tile's K is cut), no reduction
// across CTAs. The epilogue rounds acc (+ bias, added in fp32) to bf16 once. M changes how
// many tiles there are, not what any tile computes. Clusters are 1 x 1 x 1, so no TMA
// multicast changes with the grid either.

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace {

using namespace cute;

using Element = cutlass::bfloat16_t;
using Accumulator = float;
using LayoutW = cutlass::layout::RowMajor;       // A: weight [N, K]
using LayoutX = cutlass::layout::ColumnMajor;    // B: x^T [K, M], i.e. x [M, K] row-major
using LayoutOut = cutlass::layout::ColumnMajor;  // D: out^T [N, M], i.e. out [M, N] row-major
constexpr int kAlignment = 8;                    // elements: 16-byte TMA rows
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

// One GEMM per epilogue: D = acc (LinearCombination, alpha 1, beta 0) or D = acc + bias of
// the output feature, a row of D (LinCombPerRowBias, the bias in fp32), rounded to bf16 once.
template <class Fusion>
struct Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator, void, LayoutOut,
      kAlignment, Element, LayoutOut, kAlignment, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutW, kAlignment, Element,
      LayoutX, kAlignment, Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Plain = Gemm<cutlass::epilogue::fusion::LinearCombination<Element, Accumulator, void>>;
using Biased = Gemm<
    cutlass::epilogue::fusion::LinCombPerRowBias<Element, Accumulator, Element, void, Accumulator>>;

template <class G>
typename G::Device::Arguments arguments(const void* x, const void* weight, const void* bias,
                                        void* out, int m, int n, int k, int sm_count) {
  using Kernel = typename G::Kernel;
  auto stride_w = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {n, k, 1});
  auto stride_x = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {m, k, 1});
  auto stride_out = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {n, m, 1});
  cutlass::KernelHardwareInfo hardware;
  hardware.sm_count = sm_count;
  typename G::Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {n, m, k, 1},  // out^T [N, M] = weight [N, K] @ x^T [K, M]
      {static_cast<const Element*>(weight), stride_w, static_cast<const Element*>(x), stride_x},
      {{}, nullptr, stride_out, static_cast<Element*>(out), stride_out},
      hardware};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  if constexpr (std::is_same_v<G, Biased>) {
    args.epilogue.thread.bias_ptr = static_cast<const Element*>(bias);
  }
  return args;
}

// 0: runs; 1: CUTLASS cannot implement these sizes (alignment); 2: the workspace is too
// small; 3: the launch failed.
template <class G>
int run(const void* x, const void* weight, const void* bias, void* out, int m, int n, int k,
        int sm_count, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  typename G::Device gemm;
  auto args = arguments<G>(x, weight, bias, out, m, n, k, sm_count);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (G::Device::get_workspace_size(args) > workspace_bytes) return 2;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
  return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 3;
}

}  // namespace

extern "C" {

// The tile shape and instruction, for the caller's records.
const char* bik_cutlass_sm90_config() {
  return "128 features x 256 tokens x 64, HGMMA.64x256x16, cooperative";
}

// Bytes of workspace a GEMM of these sizes needs (the persistent scheduler's; host only).
size_t bik_cutlass_sm90_workspace(int m, int n, int k, int biased, int sm_count) {
  if (biased) {
    return Biased::Device::get_workspace_size(
        arguments<Biased>(nullptr, nullptr, nullptr, nullptr, m, n, k, sm_count));
  }
  return Plain::Device::get_workspace_size(
      arguments<Plain>(nullptr, nullptr, nullptr, nullptr, m, n, k, sm_count));
}

// Whether CUTLASS implements these sizes (host only: K and N multiples of 8).
int bik_cutlass_sm90_can_implement(int m, int n, int k) {
  auto args = arguments<Plain>(nullptr, nullptr, nullptr, nullptr, m, n, k, 1);
  return Plain::Kernel::can_implement(args) ? 1 : 0;
}

// out = x @ weight^T (+ bias); bias may be null. Returns 0 on success (see run()).
int bik_cutlass_sm90_linear(const void* x, const void* weight, const void* bias, void* out, int m,
                            int n, int k, int sm_count, void* workspace, size_t workspace_bytes,
                            void* stream) {
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (bias != nullptr) {
    return run<Biased>(x, weight, bias, out, m, n, k, sm_count, workspace, workspace_bytes,
                       cuda_stream);
  }
  return run<Plain>(x, weight, bias, out, m, n, k, sm_count, workspace, workspace_bytes,
                    cuda_stream);
}

}  // extern "C"
