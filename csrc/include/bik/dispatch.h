// One dtype dispatch for every kernel entry point: dispatch_dtype<Types>(code, f) calls
// f(T{}) with T the backend's element type for that dtype code (Types names the three:
// Float, BFloat16, Half), so a kernel is instantiated once per dtype from one template.
#pragma once

#include <stdexcept>
#include <string>

#include "contract.h"

namespace bik {

template <typename Types, typename F>
void dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case F32: f(typename Types::Float{}); return;
    case BF16: f(typename Types::BFloat16{}); return;
    case F16: f(typename Types::Half{}); return;
  }
  throw std::invalid_argument("bik: dtype code " + std::to_string(dtype) +
                              " is not 0 (float32), 1 (bfloat16) or 2 (float16)");
}

}  // namespace bik
