// The sm_90a grouped GEMM instances and the choice among them (sm90_kernels.h). No CUTLASS here: this file
// is built into every extension, the CPU-executed one included, so the choice is tested without a GPU.
#include "gemm/sm90_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace moe::gemm {

namespace {
constexpr auto kF = GemmOp::kFwd, kD = GemmOp::kDgrad, kW = GemmOp::kWgrad;
constexpr auto kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16, kE4M3 = DType::kFloat8E4M3, kFp32 = DType::kFloat32;
}  // namespace

// One row per instance (a MOE_*_INSTANCE in csrc/gemm/sm90/instances_*.cu, same name;
// tests/ops/test_grouped_mm_tuning.py checks that each is instantiated once, with the configuration written here).
const KernelSpec kSm90Kernels[] = {
    // name                                  op  dtype  out    pingpong tile          cluster
    {"fwd_bf16_pingpong_128x128x64_c1x1", kF, kBf16, kBf16, true, 128, 128, 64, 1, 1},
    {"fwd_bf16_coop_256x128x64_c1x1", kF, kBf16, kBf16, false, 256, 128, 64, 1, 1},
    {"fwd_bf16_coop_128x256x64_c2x1", kF, kBf16, kBf16, false, 128, 256, 64, 2, 1},
    {"fwd_fp16_pingpong_128x128x64_c1x1", kF, kFp16, kFp16, true, 128, 128, 64, 1, 1},
    {"fwd_fp16_coop_256x128x64_c1x1", kF, kFp16, kFp16, false, 256, 128, 64, 1, 1},
    {"dgrad_bf16_pingpong_128x128x64_c1x1", kD, kBf16, kBf16, true, 128, 128, 64, 1, 1},
    {"dgrad_bf16_coop_256x128x64_c1x1", kD, kBf16, kBf16, false, 256, 128, 64, 1, 1},
    {"dgrad_bf16_coop_128x256x64_c2x1", kD, kBf16, kBf16, false, 128, 256, 64, 2, 1},
    {"dgrad_fp16_pingpong_128x128x64_c1x1", kD, kFp16, kFp16, true, 128, 128, 64, 1, 1},
    {"dgrad_fp16_coop_256x128x64_c1x1", kD, kFp16, kFp16, false, 256, 128, 64, 1, 1},
    {"wgrad_bf16_coop_256x128x64_c1x1", kW, kBf16, kBf16, false, 256, 128, 64, 1, 1},
    {"wgrad_bf16_coop_128x256x64_c2x1", kW, kBf16, kBf16, false, 128, 256, 64, 2, 1},
    {"wgrad_fp16_coop_256x128x64_c1x1", kW, kFp16, kFp16, false, 256, 128, 64, 1, 1},
    {"fwd_fp8_blockwise_128x128x128_c1x1", kF, kE4M3, kBf16, false, 128, 128, 128, 1, 1},
    {"fwd_fp8_blockwise_128x128x128_c2x1", kF, kE4M3, kBf16, false, 128, 128, 128, 2, 1},
    {"wgrad_fp8_blockwise_128x128x128_c1x1", kW, kE4M3, kFp32, false, 128, 128, 128, 1, 1},
    {"wgrad_fp8_blockwise_bf16_128x128x128_c1x1", kW, kE4M3, kBf16, false, 128, 128, 128, 1, 1},
    {"fwd_fp8_blockwise_pingpong_64x128x128_c1x1", kF, kE4M3, kBf16, true, 64, 128, 128, 1, 1},
    {"wgrad_fp8_blockwise_pingpong_64x128x128_c1x1", kW, kE4M3, kFp32, true, 64, 128, 128, 1, 1},
    {"wgrad_fp8_blockwise_bf16_pingpong_64x128x128_c1x1", kW, kE4M3, kBf16, true, 64, 128, 128, 1, 1},
};
const int kNumSm90Kernels = int(sizeof(kSm90Kernels) / sizeof(kSm90Kernels[0]));

#include "gemm/sm90_table.h"

const int kSm90TableRows = int(sizeof(kSm90Table) / sizeof(kSm90Table[0]));

DType output_dtype(const GroupedParams& p) {
  if (p.dtype != DType::kFloat8E4M3) return p.dtype;
  return p.op == GemmOp::kWgrad ? p.fp8_wgrad_out : DType::kBFloat16;
}

int32_t find_sm90_kernel(const char* name) {
  for (int i = 0; i < kNumSm90Kernels; ++i)
    if (std::strcmp(kSm90Kernels[i].name, name) == 0) return i;
  return -1;
}

namespace {

bool serves(const KernelSpec& k, GemmOp op, DType dtype, DType out) {
  return k.op == op && k.dtype == dtype && k.out == out;
}

int32_t named(const char* name) {
  const int32_t i = find_sm90_kernel(name);
  if (i < 0) throw std::logic_error(std::string("grouped_mm: no sm_90a kernel named ") + name);
  return i;
}

const char* op_name(GemmOp op) { return op == GemmOp::kFwd ? "fwd" : op == GemmOp::kDgrad ? "dgrad" : "wgrad"; }

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat8E4M3: return "fp8";
    default: return "unsupported";
  }
}

// Rows per group above which ping-pong's 128-row tiles give way to cooperative's 256 (fwd and dgrad).
constexpr int64_t kPingpongMaxAvgRows = 256;

}  // namespace

Choice rule_sm90(GemmOp op, DType dtype, DType out, int32_t E, int64_t M, int64_t, int64_t) {
  std::string name;
  if (dtype == DType::kFloat8E4M3) {
    if (op == GemmOp::kFwd && out == kBf16) name = "fwd_fp8_blockwise_128x128x128_c1x1";
    if (op == GemmOp::kWgrad && out == kFp32) name = "wgrad_fp8_blockwise_128x128x128_c1x1";
    if (op == GemmOp::kWgrad && out == kBf16) name = "wgrad_fp8_blockwise_bf16_128x128x128_c1x1";
  } else if ((dtype == kBf16 || dtype == kFp16) && out == dtype) {
    const bool few_rows = op != GemmOp::kWgrad && M <= kPingpongMaxAvgRows * E;
    name = std::string(op_name(op)) + "_" + dtype_name(dtype) +
           (few_rows ? "_pingpong_128x128x64_c1x1" : "_coop_256x128x64_c1x1");
  }
  const int32_t k = name.empty() ? -1 : find_sm90_kernel(name.c_str());
  if (k < 0) {
    throw std::invalid_argument(std::string("grouped_mm: no sm_90a kernel for ") + op_name(op) + " with " +
                                dtype_name(dtype) + " operands and " + dtype_name(out) + " output");
  }
  // Along M: CUTLASS's default for grouped problems (their sizes are on the device only).
  return {k, Raster::kAlongM, -1};
}

Choice choose_sm90(GemmOp op, DType dtype, DType out, int32_t E, int64_t M, int64_t N, int64_t K) {
  const Choice rule = rule_sm90(op, dtype, out, E, M, N, K);  // also rejects what no instance serves
  int best = -1;
  double best_gap = 0;
  for (int i = 0; i < kSm90TableRows; ++i) {
    const TableRow& r = kSm90Table[i];
    if (r.op != op || r.dtype != dtype || r.out != out || r.E != E || r.N != N || r.K != K) continue;
    // Nearest M by ratio; M = 0 (an empty problem) counts as one row.
    const double gap = std::fabs(std::log(double(std::max<int64_t>(M, 1)) / double(std::max<int64_t>(r.M, 1))));
    if (best < 0 || gap < best_gap) best = i, best_gap = gap;
  }
  if (best < 0) return rule;
  return {named(kSm90Table[best].kernel), kSm90Table[best].raster, best};
}

Choice resolve_sm90(const GroupedParams& p) {
  const DType out = output_dtype(p);
  Choice c = choose_sm90(p.op, p.dtype, out, p.num_groups, p.M, p.N, p.K);
  if (p.kernel >= 0) {
    if (p.kernel >= kNumSm90Kernels || !serves(kSm90Kernels[p.kernel], p.op, p.dtype, out)) {
      throw std::invalid_argument("grouped_mm: kernel " + std::to_string(p.kernel) + " does not serve " +
                                  op_name(p.op) + " with " + dtype_name(p.dtype) + " operands and " +
                                  dtype_name(out) + " output");
    }
    c = {p.kernel, c.raster, -1};
  }
  if (p.raster >= 0) {
    if (p.raster > 1) throw std::invalid_argument("grouped_mm: raster must be 0 (along M) or 1 (along N)");
    c.raster = Raster(p.raster);
  }
  return c;
}

}  // namespace moe::gemm
