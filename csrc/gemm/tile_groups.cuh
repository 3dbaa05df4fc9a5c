// Which group a row-tile of a grouped kernel's grid belongs to (the prepare kernel writes each group's first
// tile, grouped_mm.h GroupInfo::tile_start). Shared by every kernel that maps its blocks to groups by tile
// offsets: the portable kernels, the sm_90a gather kernels and the NVFP4 scale layout.
#pragma once

#include <cstdint>

#include "gemm/grouped_mm.h"

namespace moe::gemm {

// The group that owns `tile` (below the prepared tile count): the last of the E groups whose first tile is at
// or before it. An empty group owns no tiles: its first tile is the next group's, so it is never the last.
__device__ __forceinline__ int group_of_tile(const GroupInfo* __restrict__ groups, int E, int64_t tile) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (groups[mid].tile_start <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace moe::gemm
