// What every pybind11 module of bik exports besides its kernels: the contract's numbers, so
// a test can check that the compiled backend and bik/contract.py agree.
#pragma once

#include <pybind11/pybind11.h>

#include "contract.h"

namespace bik {

inline void export_contract(pybind11::module_& m) {
  m.attr("KEY_BLOCK") = KEY_BLOCK;
  m.attr("DEFAULT_SPLIT_SIZE") = DEFAULT_SPLIT_SIZE;
  m.attr("CPU_LANES") = CPU_LANES;
  m.attr("CUDA_ROW_THREADS") = CUDA_ROW_THREADS;
  pybind11::dict codes;
  codes["float32"] = static_cast<int>(F32);
  codes["bfloat16"] = static_cast<int>(BF16);
  codes["float16"] = static_cast<int>(F16);
  m.attr("DTYPE_CODES") = codes;
}

}  // namespace bik
