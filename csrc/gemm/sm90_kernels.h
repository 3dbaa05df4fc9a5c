// The sm_90a grouped GEMM instances (one CUTLASS instantiation each) and the host-side choice among them.
//
// The list is fixed at build time and compiled into every extension, with or without the sm_90a target,
// so the choice is the same function everywhere (and testable on a CPU). The choice uses only what the
// host knows without a sync: the product, the dtypes, E, N, K and M, the rows allocated for all groups
// (the worst case; the group sizes stay on the device). It looks the shape up in the tuning table
// (sm90_table.h, written by `python -m bench tune_grouped_mm` on a GPU) and falls back to a rule for
// shapes the table does not hold, so every input has an answer.
//
// The raster order (which way the persistent scheduler walks the output tiles of a group) is a run-time
// argument of every instance: along M reuses the weight tile (B) from L2 across row tiles, along N reuses
// the token tile (A) across output columns, which matters when one expert holds many rows.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "gemm/grouped_mm.h"

namespace moe::gemm {

enum class Raster : int32_t { kAlongM = 0, kAlongN = 1 };

struct KernelSpec {
  const char* name;
  GemmOp op;
  DType dtype;  // operands: bf16, fp16 or E4M3
  DType out;    // output: the operands' dtype, bf16 for the FP8 forward, fp32 or bf16 for the FP8 wgrad
  bool pingpong;  // two consumer warp groups on alternate tiles; else cooperative on one tile
  int tile_m, tile_n, tile_k;
  int cluster_m, cluster_n;  // thread-block cluster; > 1 multicasts the shared operand tile by TMA
};

// Indexed by kernel id; the ids are the array positions (sm90_kernels.cu) and are not stable across builds:
// look kernels up by name.
extern const KernelSpec kSm90Kernels[];
extern const int kNumSm90Kernels;

// A row of the tuning table: the kernel and raster order measured fastest for one problem.
struct TableRow {
  GemmOp op;
  DType dtype, out;
  int32_t E;
  int64_t M, N, K;
  const char* kernel;
  Raster raster;
  bool tuned;  // false: the rule's choice, written down for a shape no GPU run has swept yet
};
extern const TableRow kSm90Table[];
extern const int kSm90TableRows;

struct Choice {
  int32_t kernel;  // index into kSm90Kernels
  Raster raster;
  int32_t table_row;  // the row it came from, -1 for the rule
};

// The output dtype the product writes (see KernelSpec::out).
DType output_dtype(const GroupedParams& p);

// The kernel for (op, dtype, out, E, M, N, K): the table row of the same op, dtypes, E, N and K whose M is
// nearest (by ratio), else the rule. Throws std::invalid_argument for a combination no instance serves
// (fp32 operands, an FP8 dgrad): callers run the portable kernel for those before asking.
Choice choose_sm90(GemmOp op, DType dtype, DType out, int32_t E, int64_t M, int64_t N, int64_t K);

// The rule alone (what the table holds for a shape no GPU run has swept).
Choice rule_sm90(GemmOp op, DType dtype, DType out, int32_t E, int64_t M, int64_t N, int64_t K);

// Index of the kernel with this name, -1 if none.
int32_t find_sm90_kernel(const char* name);

// The choice for p, with p.kernel / p.raster (>= 0) taking precedence; a requested kernel must serve p's
// op and dtypes (std::invalid_argument otherwise).
Choice resolve_sm90(const GroupedParams& p);

}  // namespace moe::gemm
