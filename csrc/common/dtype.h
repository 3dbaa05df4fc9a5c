// Element types crossing the Python boundary, as small integer codes (no torch headers here).
#pragma once

#include <cstdint>

namespace moe {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kUInt8 = 5,
  kFloat4E2M1 = 6,  // NVFP4 codes, two a byte (the first element in the low nibble); sizes count elements
};

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    default: return 1;
  }
}

}  // namespace moe
