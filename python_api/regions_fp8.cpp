// The FP8 blockwise recipe's routed experts as one call each way (moe_kernels/nn/fused_fp8.py, the `moe_fp8`
// region): the launches of the recipe's functions on the same operands, in their order, issued from here on one
// stream. The regions' workspace convention (regions.cpp): a call returns 0 when it launched, else the workspace
// bytes it needs (nothing launched). The E4M3 operands that live only inside one direction (the GEMMs' inputs in
// the forward layout, the dequantization scales, the backward's E4M3 gradients) are carved from that workspace.
//
// Shapes: x [T, H] bf16, indices [T, k], R permuted rows (Rp = R rounded up to 128), the up projection's width F2
// (2F for SwiGLU, F for the squared ReLU), Xp = X rounded up to 128 and Xb = Xp / 128 for any width X. The weights
// come as the weight cache's tiles (weight_cache.Fp8ExpertWeights.gemm_tiles): codes [E, N, Kp] and scales
// [E, ceil(N / 128), Kb] of w13 [E, F2, H] and w2 [E, H, F], and of their transposes for dgrad.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "activation/rows_fp8.h"
#include "activation/swiglu.h"
#include "gemm/grouped_mm.h"
#include "permute/permute.h"
#include "quant/fp8.h"
#include "registry.h"

namespace py = pybind11;

namespace moe::api {

namespace {

using gemm::GemmOp;

constexpr int64_t kBlock = 128;
int64_t up128(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }
int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Consecutive parts of one workspace, each at a multiple of 256 bytes from `base`; used() is their total.
class Carver {
 public:
  explicit Carver(uintptr_t base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const size_t at = used_;
    used_ += (size_t(count) * sizeof(T) + 255) / 256 * 256;
    return reinterpret_cast<T*>(base_ + at);
  }
  size_t used() const { return used_; }

 private:
  uintptr_t base_;
  size_t used_ = 0;
};

// An E4M3 [rows, cols] value in the dual-layout producers' two layouts: codes [rows, colsp] with scales
// [rows, colsb] (the forward's and dgrad's operand), and token-major codes [cols, rowsp] with scales [cols, rowsb]
// (wgrad's operand).
struct Fp8Layouts {
  uint8_t* q;
  float* scale;
  uint8_t* q_t;
  float* scale_t;
};

struct Fp8Rows {  // the first layout only
  uint8_t* q;
  float* scale;
};

Fp8Rows carve_rows(Carver& c, int64_t rows, int64_t cols) {
  return {c.take<uint8_t>(rows * up128(cols)), c.take<float>(rows * blocks(cols))};
}

// One FP8 blockwise GEMM and the two dequantization-scale tensors its kernel reads (fp8_dequant_scales of its
// operands' scales: 1 / scale, 0 for a zero scale; transposed for wgrad), as ops/grouped_mm_fp8.py launches it.
struct Fp8Gemm {
  gemm::GroupedParams p;
  const float* a_scale;  // the operands' quantization scales, as matrices [a_rows, a_cols], [b_rows, b_cols]
  const float* b_scale;
  int64_t a_rows, a_cols, b_rows, b_cols;

  bool has_kernel() const {
    const gemm::Path path = gemm::choose_path(p);
    return path == gemm::Path::kSm90Fp8Blockwise || path == gemm::Path::kSm100Fp8Blockwise ||
           path == gemm::Path::kPortableMma;
  }
  void run(cudaStream_t s) const {
    const bool transpose = p.op == GemmOp::kWgrad;
    quant::fp8_dequant_scales({a_scale, const_cast<float*>(p.sfa), a_rows, a_cols, b_scale, const_cast<float*>(p.sfb),
                               b_rows, b_cols, transpose},
                              s);
    gemm::grouped_mm(p, s);
  }
};

gemm::GroupedParams fp8_params(GemmOp op, const void* a, const void* b, void* d, const int32_t* group_sizes, int32_t E,
                               int64_t M, int64_t N, int64_t K, int device) {
  gemm::GroupedParams p{op, a, b, d, group_sizes, E, M, N, K, DType::kFloat8E4M3, nullptr, 0, device};
  return p;
}

// The forward product out [M, N] bf16 = a [M, Kp] (scales [M, Kb]) times the tiles w [E, N, Kp] (scales
// [E, ceil(N / 128), Kb]), its dequantization scales carved from c.
Fp8Gemm fp8_fwd(Carver& c, const uint8_t* a, const float* a_scale, uintptr_t w, uintptr_t w_scale, void* out,
                const int32_t* group_sizes, int32_t E, int64_t M, int64_t N, int64_t K, int device) {
  const int64_t Kb = blocks(K), Nb = blocks(N);
  Fp8Gemm g{fp8_params(GemmOp::kFwd, a, ptr<const void>(w), out, group_sizes, E, M, N, up128(K), device), a_scale,
            ptr<const float>(w_scale), M, Kb, E * Nb, Kb};
  g.p.sfa = c.take<float>(M * Kb);
  g.p.sfb = c.take<float>(E * Nb * Kb);
  return g;
}

// The weight gradient d [E, N, K] = a^T b over each group's rows, from the token-major layouts a [N, Rp] and
// b [K, Rp] (scales [N, Rb], [K, Rb]); d in `out` (float32, or bfloat16 rounded in the epilogue), added into d
// with `accumulate`.
Fp8Gemm fp8_wgrad(Carver& c, const Fp8Layouts& a, const Fp8Layouts& b, void* d, int32_t out, bool accumulate,
                  const int32_t* group_sizes, int32_t E, int64_t R, int64_t N, int64_t K, int device) {
  if (accumulate && out != int32_t(DType::kFloat32)) {
    throw std::invalid_argument("moe_fp8_bwd: a weight gradient is accumulated only into float32 (dtype code 0)");
  }
  const int64_t Rp = up128(R), Rb = blocks(R);
  Fp8Gemm g{fp8_params(GemmOp::kWgrad, a.q_t, b.q_t, d, group_sizes, E, Rp, N, K, device), a.scale_t, b.scale_t, N,
            Rb, K, Rb};
  g.p.fp8_wgrad_out = DType(out);
  g.p.accumulate = accumulate;
  g.p.sfa = c.take<float>(Rb * N);
  g.p.sfb = c.take<float>(Rb * K);
  return g;
}

Fp8Layouts carve_layouts(Carver& c, int64_t rows, int64_t cols) {
  const Fp8Rows r = carve_rows(c, rows, cols);
  return {r.q, r.scale, c.take<uint8_t>(cols * up128(rows)), c.take<float>(cols * blocks(rows))};
}

size_t gemm_need(std::initializer_list<const Fp8Gemm*> gemms) {
  size_t need = 0;
  for (const auto* g : gemms) need = std::max(need, gemm::grouped_workspace_bytes(g->p));
  return need;
}

void require_kernels(std::initializer_list<const Fp8Gemm*> gemms, const char* where) {
  for (const auto* g : gemms) {
    if (g->p.d != nullptr && !g->has_kernel()) {
      throw std::invalid_argument(std::string(where) + ": an expert GEMM has no FP8 kernel on this GPU (moe_fp8_path "
                                  "says where the region applies)");
    }
  }
}

void set_workspace(std::initializer_list<Fp8Gemm*> gemms, void* ws, size_t bytes) {
  for (auto* g : gemms) {
    g->p.workspace = ws;
    g->p.workspace_bytes = bytes;
  }
}

enum class Act : int32_t { kSwiglu = 0, kSquaredRelu = 1 };

Act act_of(int32_t code) {
  if (code != 0 && code != 1) {
    throw std::invalid_argument("moe_fp8 regions: activation code must be 0 (swiglu) or 1 (squared_relu), got " +
                                std::to_string(code));
  }
  return Act(code);
}

// An entry's sizes and activation checked (T, k, R, H, F and E positive, as the region's `fits` has them; moe_fp8_path
// answers false elsewhere): the up projection's width F2.
int64_t checked_width(const char* where, int64_t tokens, int64_t k, int64_t rows, int64_t hidden, int64_t ffn,
                      int32_t E, int32_t act) {
  if (tokens <= 0 || k <= 0 || rows <= 0 || hidden <= 0 || ffn <= 0 || E <= 0) {
    throw std::invalid_argument(std::string(where) + ": tokens, k, rows, hidden, ffn and num_experts must be "
                                "positive, got " + std::to_string(tokens) + ", " + std::to_string(k) + ", " +
                                std::to_string(rows) + ", " + std::to_string(hidden) + ", " + std::to_string(ffn) +
                                ", " + std::to_string(E));
  }
  return act_of(act) == Act::kSwiglu ? 2 * ffn : ffn;
}

// The stand-in base of a region's sizing pass and of the path query: the GEMMs' choice (and so their workspace)
// depends on their operands' alignment and on the scales being given, so those passes hand out addresses as aligned
// as the real ones, and none null.
constexpr uintptr_t kSizingBase = 256;

}  // namespace

void register_regions_fp8(py::module_& m) {
  // Whether every expert GEMM of moe_fp8_fwd / moe_fp8_bwd at these sizes has an FP8 kernel on `device` (the
  // sm_90a or sm_100f blockwise kernel, or the tensor-core portable one), wgrad in float32 and bfloat16 alike;
  // where one does not, the layer runs the recipe's functions (their dequantizing fallback).
  m.def(
      "moe_fp8_path",
      [](int64_t rows, int64_t hidden, int64_t ffn, int32_t act, int32_t E, int device) -> bool {
        DeviceGuard guard(device);
        if (rows <= 0 || hidden <= 0 || ffn <= 0 || E <= 0) return false;
        const int64_t width = act_of(act) == Act::kSwiglu ? 2 * ffn : ffn;
        Carver c(kSizingBase);
        auto* q = reinterpret_cast<uint8_t*>(kSizingBase);
        auto* f = reinterpret_cast<float*>(kSizingBase);
        const Fp8Layouts l{q, f, q, f};
        const uintptr_t w = kSizingBase;
        const Fp8Gemm gemms[] = {
            fp8_fwd(c, q, f, w, w, q, nullptr, E, rows, width, hidden, device),   // up
            fp8_fwd(c, q, f, w, w, q, nullptr, E, rows, hidden, ffn, device),     // down
            fp8_fwd(c, q, f, w, w, q, nullptr, E, rows, ffn, hidden, device),     // da
            fp8_fwd(c, q, f, w, w, q, nullptr, E, rows, hidden, width, device),   // dx
            fp8_wgrad(c, l, l, q, 0, false, nullptr, E, rows, hidden, ffn, device),     // dw2, float32
            fp8_wgrad(c, l, l, q, 2, false, nullptr, E, rows, hidden, ffn, device),     // dw2, bfloat16
            fp8_wgrad(c, l, l, q, 0, false, nullptr, E, rows, width, hidden, device),   // dw13, float32
            fp8_wgrad(c, l, l, q, 2, false, nullptr, E, rows, width, hidden, device)};  // dw13, bfloat16
        for (const auto& g : gemms) {
          if (!g.has_kernel()) return false;
        }
        return true;
      },
      py::arg("rows"), py::arg("hidden"), py::arg("ffn"), py::arg("act"), py::arg("num_experts"), py::arg("device"));

  // The forward: permute (the routing only), each row's slot (rows_to_tokens), the tokens gathered into both E4M3
  // layouts of the permuted rows (unpermute_bwd_fp8), the up projection, the activation writing both layouts of its
  // output (swiglu_fwd_fp8, or rows_fp8's squared ReLU), the down projection, the weighted unpermute. x [T, H],
  // indices [T, k], weights [T, k] fp32 (0: a plain sum), w13 / w2: the forward tiles and their scales. Written for
  // the backward: row_map [T, k], group_sizes [E] (E = num_experts), slot [R], x_t (x's token-major layout: codes
  // [H, Rp], scales [H, Rb]), h [R, F2] bf16, a_t ([F, Rp], [F, Rb]), and y [R, H] bf16 when non-zero (else
  // scratch); out [T, H] bf16.
  m.def(
      "moe_fp8_fwd",
      [](uintptr_t x, uintptr_t indices, uintptr_t weights, uintptr_t w13, uintptr_t w13_scale, uintptr_t w2,
         uintptr_t w2_scale, uintptr_t row_map, uintptr_t group_sizes, uintptr_t slot, uintptr_t x_tq, uintptr_t x_ts,
         uintptr_t h, uintptr_t a_tq, uintptr_t a_ts, uintptr_t y, uintptr_t out, int64_t tokens, int64_t k,
         int64_t rows, int64_t hidden, int64_t ffn, int32_t E, int32_t align, int32_t act, bool pow2,
         uintptr_t workspace, size_t ws_bytes, int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const int64_t width = checked_width("moe_fp8_fwd", tokens, k, rows, hidden, ffn, E, act);
        const bool swiglu = act == int32_t(Act::kSwiglu);
        // The scratch, carved once the size is known to fit (a first pass at a stand-in base sizes it).
        auto plan = [&](uintptr_t base) {
          Carver c(base);
          struct Plan {
            Fp8Rows xq, aq;
            void* y;
            Fp8Gemm up, down;
            size_t scratch;
          } p{carve_rows(c, rows, hidden), carve_rows(c, rows, ffn),
              y ? ptr<void>(y) : static_cast<void*>(c.take<uint16_t>(rows * hidden)), {}, {}, 0};
          p.up = fp8_fwd(c, p.xq.q, p.xq.scale, w13, w13_scale, ptr<void>(h), ptr<const int32_t>(group_sizes), E, rows, width, hidden, device);
          p.down = fp8_fwd(c, p.aq.q, p.aq.scale, w2, w2_scale, p.y, ptr<const int32_t>(group_sizes), E, rows, hidden, ffn, device);
          p.scratch = c.used();
          return p;
        };
        auto counted = plan(kSizingBase);
        const size_t gemm_ws = std::max(permute::permute_workspace_bytes(tokens * k, E), gemm_need({&counted.up, &counted.down}));
        const size_t need = counted.scratch + gemm_ws;
        if (ws_bytes < need) return need;
        auto p = plan(workspace);
        void* ws = ptr<void>(workspace + p.scratch);
        set_workspace({&p.up, &p.down}, ws, gemm_ws);
        require_kernels({&p.up, &p.down}, "moe_fp8_fwd");
        const cudaStream_t st = stream(s);
        const DType bf16 = DType::kBFloat16;
        permute::permute_fwd({nullptr, ptr<const int32_t>(indices), nullptr, ptr<int32_t>(row_map),
                              ptr<int32_t>(group_sizes), ws, tokens, k, 0, E, align},
                             st);
        permute::rows_to_tokens(ptr<const int32_t>(row_map), tokens * k, 1, rows, ptr<int32_t>(slot), st);
        permute::unpermute_bwd_fp8({ptr<const void>(x), ptr<const int32_t>(slot), nullptr, p.xq.q, p.xq.scale,
                                    ptr<uint8_t>(x_tq), ptr<float>(x_ts), tokens, k, hidden, rows, pow2, bf16},
                                   st);
        p.up.run(st);
        if (swiglu) {
          activation::swiglu_fwd_fp8({ptr<const void>(h), nullptr, p.aq.q, p.aq.scale, ptr<uint8_t>(a_tq),
                                      ptr<float>(a_ts), rows, ffn, pow2, bf16},
                                     st);
        } else {
          activation::rows_fp8({activation::RowsFp8Op::kSquaredRelu, ptr<const void>(h), nullptr, p.aq.q, p.aq.scale,
                                ptr<uint8_t>(a_tq), ptr<float>(a_ts), rows, ffn, pow2, bf16},
                               st);
        }
        p.down.run(st);
        permute::unpermute_fwd({p.y, ptr<const int32_t>(row_map), ptr<const float>(weights), ptr<void>(out), tokens,
                                k, hidden, rows, bf16},
                               st);
        return 0;
      });

  // The backward: dout [T, H] bf16 (16-byte aligned) gathered, times each slot's weight, into both E4M3 layouts of
  // dy (unpermute_bwd_fp8); dweights [T, k] fp32 from unpermute_bwd's reduction (reads y; when non-zero); the down
  // projection's dgrad (w2's transposed tiles) and wgrad into dw2; the activation's backward writing dh in both
  // layouts (swiglu_bwd_fp8, or rows_fp8's); the up projection's wgrad into dw13 and dgrad (w13's transposed tiles,
  // when dx is non-zero), then the permute's backward (an unpermute of dx_perm) into dx [T, H]. dw13 [E, F2, H] and
  // dw2 [E, H, F] in their dtype codes (0 float32, 2 bfloat16), each added into where its accumulate flag is set
  // (float32 only); either may be 0 (not wanted).
  m.def(
      "moe_fp8_bwd",
      [](uintptr_t dout, uintptr_t weights, uintptr_t w13t, uintptr_t w13t_scale, uintptr_t w2t, uintptr_t w2t_scale,
         uintptr_t row_map, uintptr_t group_sizes, uintptr_t slot, uintptr_t x_tq, uintptr_t x_ts, uintptr_t h,
         uintptr_t a_tq, uintptr_t a_ts, uintptr_t y, uintptr_t dx, uintptr_t dw13, int32_t dw13_dtype,
         bool dw13_accumulate, uintptr_t dw2, int32_t dw2_dtype, bool dw2_accumulate, uintptr_t dweights,
         int64_t tokens, int64_t k, int64_t rows, int64_t hidden, int64_t ffn, int32_t E, int32_t act, bool pow2,
         uintptr_t workspace, size_t ws_bytes, int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const int64_t width = checked_width("moe_fp8_bwd", tokens, k, rows, hidden, ffn, E, act);
        const bool swiglu = act == int32_t(Act::kSwiglu);
        const Fp8Layouts x_t{nullptr, nullptr, ptr<uint8_t>(x_tq), ptr<float>(x_ts)};
        const Fp8Layouts a_t{nullptr, nullptr, ptr<uint8_t>(a_tq), ptr<float>(a_ts)};
        auto plan = [&](uintptr_t base) {
          Carver c(base);
          struct Plan {
            Fp8Layouts dy, dh;
            void* da;
            void* dx_perm;
            Fp8Gemm dgrad2, wgrad2, wgrad13, dgrad13;
            size_t scratch;
          } p{carve_layouts(c, rows, hidden), carve_layouts(c, rows, width),
              c.take<uint16_t>(rows * ffn), dx ? static_cast<void*>(c.take<uint16_t>(rows * hidden)) : nullptr,
              {}, {}, {}, {}, 0};
          p.dgrad2 = fp8_fwd(c, p.dy.q, p.dy.scale, w2t, w2t_scale, p.da, ptr<const int32_t>(group_sizes), E, rows, ffn, hidden, device);
          p.wgrad2 = fp8_wgrad(c, p.dy, a_t, ptr<void>(dw2), dw2_dtype, dw2_accumulate, ptr<const int32_t>(group_sizes), E, rows, hidden, ffn,
                               device);
          p.wgrad13 = fp8_wgrad(c, p.dh, x_t, ptr<void>(dw13), dw13_dtype, dw13_accumulate, ptr<const int32_t>(group_sizes), E, rows, width,
                                hidden, device);
          p.dgrad13 = fp8_fwd(c, p.dh.q, p.dh.scale, w13t, w13t_scale, p.dx_perm, ptr<const int32_t>(group_sizes), E, rows, hidden, width,
                              device);
          p.scratch = c.used();
          return p;
        };
        auto counted = plan(kSizingBase);
        const size_t gemm_ws = gemm_need({&counted.dgrad2, &counted.wgrad2, &counted.wgrad13, &counted.dgrad13});
        const size_t need = counted.scratch + gemm_ws;
        if (ws_bytes < need) return need;
        auto p = plan(workspace);
        set_workspace({&p.dgrad2, &p.wgrad2, &p.wgrad13, &p.dgrad13}, ptr<void>(workspace + p.scratch), gemm_ws);
        require_kernels({&p.dgrad2, &p.wgrad2, &p.wgrad13, &p.dgrad13}, "moe_fp8_bwd");
        const cudaStream_t st = stream(s);
        const DType bf16 = DType::kBFloat16;
        permute::unpermute_bwd_fp8({ptr<const void>(dout), ptr<const int32_t>(slot), ptr<const float>(weights),
                                    p.dy.q, p.dy.scale, p.dy.q_t, p.dy.scale_t, tokens, k, hidden, rows, pow2, bf16},
                                   st);
        if (dweights) {  // unpermute_bwd's own reduction (dy not written)
          permute::unpermute_bwd({ptr<const void>(dout), ptr<const void>(y), ptr<const int32_t>(row_map),
                                  ptr<const float>(weights), nullptr, ptr<float>(dweights), nullptr, tokens, k, hidden,
                                  rows, bf16},
                                 st);
        }
        p.dgrad2.run(st);
        if (dw2) p.wgrad2.run(st);
        if (swiglu) {
          activation::swiglu_bwd_fp8({p.da, ptr<const void>(h), nullptr, p.dh.q, p.dh.scale, p.dh.q_t, p.dh.scale_t,
                                      rows, ffn, pow2, bf16},
                                     st);
        } else {
          activation::rows_fp8({activation::RowsFp8Op::kSquaredReluBwd, ptr<const void>(h), p.da, p.dh.q, p.dh.scale,
                                p.dh.q_t, p.dh.scale_t, rows, ffn, pow2, bf16},
                               st);
        }
        if (dw13) p.wgrad13.run(st);
        if (dx) {
          p.dgrad13.run(st);
          permute::unpermute_fwd({p.dx_perm, ptr<const int32_t>(row_map), nullptr, ptr<void>(dx), tokens, k, hidden,
                                  rows, bf16},
                                 st);
        }
        return 0;
      });
}

}  // namespace moe::api
