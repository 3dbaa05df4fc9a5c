// Fused regions of the MoE layer (moe_kernels/nn/fused.py): one Python -> C++ call per autograd node,
// positional arguments, every launch of the region issued from here on one stream.
//
// A region that needs a workspace takes (workspace, workspace_bytes) and returns the bytes it needs:
// 0 when it launched, or the size to allocate when the given workspace is too small (nothing launched).
// The caller remembers that size per shape, so the steady state is one call.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "activation/squared_relu.h"
#include "activation/swiglu.h"
#include "gemm/grouped_mm.h"
#include "permute/permute.h"
#include "registry.h"

namespace py = pybind11;

namespace moe::api {

namespace {

using gemm::GemmOp;

gemm::GroupedParams gemm_params(GemmOp op, uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_sizes, int32_t E,
                                int64_t M, int64_t N, int64_t K, DType dtype, uintptr_t workspace, size_t ws_bytes,
                                int device) {
  return gemm::GroupedParams{op,    ptr<const void>(a), ptr<const void>(b), ptr<void>(d), ptr<const int32_t>(group_sizes),
                             E,     M,                  N,                  K,            dtype,
                             ptr<void>(workspace),      ws_bytes,           device};
}

size_t need_of(std::initializer_list<const gemm::GroupedParams*> gemms) {
  size_t need = 0;
  for (const auto* g : gemms) need = std::max(need, gemm::grouped_workspace_bytes(*g));
  return need;
}

// The experts' activation: SwiGLU on [gate | up] (h [R, 2F]), or the squared ReLU of experts without a gate
// (h [R, F], no row weights).
enum class Act : int32_t { kSwiglu = 0, kSquaredRelu = 1 };

Act act_of(int32_t code) {
  if (code != int32_t(Act::kSwiglu) && code != int32_t(Act::kSquaredRelu)) {
    throw std::invalid_argument("moe regions: activation code must be 0 (swiglu) or 1 (squared_relu), got " +
                                std::to_string(code));
  }
  return Act(code);
}

int64_t up_width(Act act, int64_t ffn) { return act == Act::kSwiglu ? 2 * ffn : ffn; }

// The experts' forward: x [R, H] -> h = x W13^T [R, 2F], a = swiglu(h, row_weights) [R, F], y = a W2^T [R, H]
// (squared ReLU: h [R, F], a = relu(h)^2).
struct ExpertsFwd {
  gemm::GroupedParams up, down;
  const void* h;
  const float* row_weights;
  void* a;
  Act act;

  size_t need() const { return need_of({&up, &down}); }
  void run(int64_t rows, int64_t ffn, DType dt, cudaStream_t s) const {
    gemm::grouped_mm(up, s);
    if (act == Act::kSwiglu) {
      activation::swiglu_fwd({h, row_weights, a, rows, ffn, dt}, s);
    } else {
      activation::squared_relu_fwd({h, a, rows * ffn, dt}, s);
    }
    gemm::grouped_mm(down, s);
  }
};

ExpertsFwd experts_fwd_params(uintptr_t x, uintptr_t w13, uintptr_t w2, uintptr_t group_sizes, uintptr_t row_weights,
                              uintptr_t h, uintptr_t a, uintptr_t y, int64_t rows, int64_t hidden, int64_t ffn,
                              int32_t E, DType dt, uintptr_t workspace, size_t ws_bytes, int device,
                              Act act = Act::kSwiglu) {
  return {gemm_params(GemmOp::kFwd, x, w13, h, group_sizes, E, rows, up_width(act, ffn), hidden, dt, workspace,
                      ws_bytes, device),
          gemm_params(GemmOp::kFwd, a, w2, y, group_sizes, E, rows, hidden, ffn, dt, workspace, ws_bytes, device),
          ptr<const void>(h), ptr<const float>(row_weights), ptr<void>(a), act};
}

// Its backward's five products: dy [R, H] -> da = dy W2 [R, F], dh = swiglu_bwd(da, h) [R, 2F] (and drow_weights;
// squared ReLU: dh = 2 relu(h) da [R, F]), which also writes the forward's activation a again (bit for bit; the
// forward keeps only h), dw2 = dy^T a, dx = dh W13 [R, H], dw13 = dh^T x. run_head launches the first three (a and
// dw2 only when dw2 is asked for); the caller launches dx and dw13, with whatever goes between.
struct ExpertsBwd {
  gemm::GroupedParams da, dw2, dx, dw13;
  activation::SwigluBwdParams grad;  // the activation's backward (the squared ReLU reads its da, h, dh, act, sizes)
  Act act;

  size_t need() const { return need_of({&da, &dw2, &dx, &dw13}); }
  void run_head(cudaStream_t s) const {
    gemm::grouped_mm(da, s);
    if (act == Act::kSwiglu) {
      activation::swiglu_bwd(grad, s);
    } else {
      activation::squared_relu_bwd({grad.dout, grad.h, grad.dh, grad.rows * grad.ffn, grad.dtype, grad.act}, s);
    }
    if (dw2.d) gemm::grouped_mm(dw2, s);
  }
};

ExpertsBwd experts_bwd_params(uintptr_t dy, uintptr_t x, uintptr_t h, uintptr_t a, uintptr_t w13, uintptr_t w2,
                              uintptr_t group_sizes, uintptr_t row_weights, uintptr_t da, uintptr_t dh, uintptr_t dx,
                              uintptr_t dw13, uintptr_t dw2, uintptr_t drow_weights, int64_t rows, int64_t hidden,
                              int64_t ffn, int32_t E, DType dt, uintptr_t workspace, size_t ws_bytes, int device,
                              Act act = Act::kSwiglu) {
  const int64_t width = up_width(act, ffn);
  return {
      gemm_params(GemmOp::kDgrad, dy, w2, da, group_sizes, E, rows, hidden, ffn, dt, workspace, ws_bytes, device),
      gemm_params(GemmOp::kWgrad, dy, a, dw2, group_sizes, E, rows, hidden, ffn, dt, workspace, ws_bytes, device),
      gemm_params(GemmOp::kDgrad, dh, w13, dx, group_sizes, E, rows, width, hidden, dt, workspace, ws_bytes, device),
      gemm_params(GemmOp::kWgrad, dh, x, dw13, group_sizes, E, rows, width, hidden, dt, workspace, ws_bytes, device),
      {ptr<const void>(da), ptr<const void>(h), ptr<const float>(row_weights), ptr<void>(dh), ptr<float>(drow_weights),
       rows, ffn, dt, dw2 ? ptr<void>(a) : nullptr},
      act};
}

}  // namespace

void register_regions(py::module_& m) {
  // y = swiglu(x W13^T, row_weights) W2^T per expert group. x [R, H], w13 [E, 2F, H], w2 [E, H, F];
  // h [R, 2F] is written for the backward, a [R, F] is scratch; R > 0. group_sizes 0: every row is expert 0's (a
  // dense SwiGLU MLP with E = 1, the shared experts' `mlp` region). act: 0 SwiGLU, 1 the squared ReLU of experts
  // without a gate (w13 [E, F, H], h [R, F], no row weights).
  m.def(
      "experts_fwd",
      [](uintptr_t x, uintptr_t w13, uintptr_t w2, uintptr_t group_sizes, uintptr_t row_weights, uintptr_t h,
         uintptr_t a, uintptr_t y, int64_t rows, int64_t hidden, int64_t ffn, int32_t E, int32_t act, int32_t dtype,
         uintptr_t workspace, size_t ws_bytes, int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        const Act activation = act_of(act);
        if (activation == Act::kSquaredRelu && row_weights) {
          throw std::invalid_argument("experts_fwd: the squared ReLU takes no row weights (act 1, row_weights set)");
        }
        const auto mlp =
            experts_fwd_params(x, w13, w2, group_sizes, row_weights, h, a, y, rows, hidden, ffn, E, dt, workspace,
                               ws_bytes, device, activation);
        const size_t need = mlp.need();
        if (ws_bytes < need) return need;
        mlp.run(rows, ffn, dt, stream(s));
        return 0;
      });
  // The backward of experts_fwd: dy [R, H] -> dx [R, H], dw13, dw2, drow_weights [R] fp32 (each only when its
  // pointer is non-zero; none for act 1); da [R, F], dh [R, 2F] ([R, F] for act 1) and a [R, F] (the activation
  // again, for dw2; 0 without dw2) are scratch.
  m.def(
      "experts_bwd",
      [](uintptr_t dy, uintptr_t x, uintptr_t h, uintptr_t a, uintptr_t w13, uintptr_t w2, uintptr_t group_sizes,
         uintptr_t row_weights, uintptr_t da, uintptr_t dh, uintptr_t dx, uintptr_t dw13, uintptr_t dw2,
         uintptr_t drow_weights, int64_t rows, int64_t hidden, int64_t ffn, int32_t E, int32_t act, int32_t dtype,
         uintptr_t workspace, size_t ws_bytes, int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        const Act activation = act_of(act);
        if (activation == Act::kSquaredRelu && (row_weights || drow_weights)) {
          throw std::invalid_argument("experts_bwd: the squared ReLU takes no row weights (act 1, row_weights or "
                                      "drow_weights set)");
        }
        const auto mlp = experts_bwd_params(dy, x, h, a, w13, w2, group_sizes, row_weights, da, dh, dx, dw13, dw2,
                                            drow_weights, rows, hidden, ffn, E, dt, workspace, ws_bytes, device,
                                            activation);
        const size_t need = mlp.need();
        if (ws_bytes < need) return need;
        mlp.run_head(stream(s));
        if (dx) gemm::grouped_mm(mlp.dx, stream(s));
        if (dw13) gemm::grouped_mm(mlp.dw13, stream(s));
        return 0;
      });

  // The routed experts of the plain local layer, tokens in, tokens out: permute, the experts (grouped GEMM,
  // SwiGLU, grouped GEMM) and the weighted unpermute, the launches of the permute, experts and unpermute
  // entries above in their order. x [T, H], indices [T, k], weights [T, k] fp32 (0: a plain sum);
  // h [R, 2F] and y [R, H] are written for the backward (y only for the weights' gradient; the backward permutes
  // x again); x_perm [R, H], row_map [T, k], group_sizes [E] and a [R, F] are scratch; out [T, H]. The permute and
  // the GEMMs share the workspace (they run in order on one stream).
  // act: 0 SwiGLU, 1 the squared ReLU of experts without a gate (w13 [E, F, H], h [R, F]).
  // row_weights: 0, the weights applied in the unpermute; else [R] fp32 scratch: the weights applied in the
  // activation instead (SwiGLU only; moved to their rows, slot_values_to_rows), the unpermute a plain sum (y is then
  // not needed for the weights' gradient: 0).
  m.def(
      "moe_fwd",
      [](uintptr_t x, uintptr_t indices, uintptr_t weights, uintptr_t w13, uintptr_t w2, uintptr_t x_perm,
         uintptr_t row_map, uintptr_t group_sizes, uintptr_t row_weights, uintptr_t h, uintptr_t a, uintptr_t y,
         uintptr_t out, int64_t tokens, int64_t k, int64_t rows, int64_t hidden, int64_t ffn, int32_t E,
         int32_t align, int32_t act, int32_t dtype, uintptr_t workspace, size_t ws_bytes, int device,
         uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        const Act activation = act_of(act);
        if (row_weights && (activation != Act::kSwiglu || !weights)) {
          throw std::invalid_argument("moe_fwd: the weights in the activation (row_weights set) need SwiGLU (act 0) "
                                      "and the weights");
        }
        const auto mlp = experts_fwd_params(x_perm, w13, w2, group_sizes, row_weights, h, a, y, rows, hidden, ffn, E,
                                            dt, workspace, ws_bytes, device, activation);
        const size_t need = std::max(permute::permute_workspace_bytes(tokens * k, E), mlp.need());
        if (ws_bytes < need) return need;
        permute::permute_fwd({ptr<const void>(x), ptr<const int32_t>(indices), ptr<void>(x_perm), ptr<int32_t>(row_map),
                              ptr<int32_t>(group_sizes), ptr<void>(workspace), tokens, k, hidden * dtype_size(dt), E,
                              align},
                             stream(s));
        if (row_weights) {
          permute::slot_values_to_rows(ptr<const int32_t>(row_map), ptr<const float>(weights), tokens * k, rows,
                                       ptr<float>(row_weights), stream(s));
        }
        if (rows > 0) mlp.run(rows, ffn, dt, stream(s));
        permute::unpermute_fwd({ptr<const void>(y), ptr<const int32_t>(row_map),
                                row_weights ? nullptr : ptr<const float>(weights), ptr<void>(out), tokens, k, hidden,
                                rows, dt},
                               stream(s));
        return 0;
      });
  // Its backward: dout [T, H] -> dx [T, H], dw13, dw2, dweights [T, k] fp32 (each only when its pointer is
  // non-zero; dweights reads y, or with the weights in the activation comes from the activation's backward): the
  // permute again from x and indices (bit for bit the forward's: the forward keeps no permuted copy of x; without
  // dw13 the routing alone, no rows copied), the unpermute's backward, the experts' five products, the permute's
  // backward (an unpermute of dx_perm). x_perm [R, H] (0 without dw13), row_map [T, k], group_sizes [E], dy [R, H],
  // da [R, F], dh [R, 2F] ([R, F] for act 1), dx_perm [R, H] and a [R, F] (the activation again, for dw2; 0 without
  // dw2) are scratch; with the weights in the activation also row_weights [R] and drow_weights [R] (0 without
  // dweights); the permute's workspace and then the unpermute backward's row mask live in the workspace. R > 0.
  m.def(
      "moe_bwd",
      [](uintptr_t dout, uintptr_t x, uintptr_t indices, uintptr_t weights, uintptr_t h, uintptr_t a, uintptr_t y,
         uintptr_t w13, uintptr_t w2, uintptr_t x_perm, uintptr_t row_map, uintptr_t group_sizes,
         uintptr_t row_weights, uintptr_t drow_weights, uintptr_t dy, uintptr_t da, uintptr_t dh, uintptr_t dx_perm,
         uintptr_t dx, uintptr_t dw13, uintptr_t dw2, uintptr_t dweights, int64_t tokens, int64_t k, int64_t rows,
         int64_t hidden, int64_t ffn, int32_t E, int32_t align, int32_t act, int32_t dtype, uintptr_t workspace,
         size_t ws_bytes, int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        const Act activation = act_of(act);
        if (dw13 && !x_perm) {
          throw std::invalid_argument("moe_bwd: dw13 needs the x_perm scratch (the permuted rows of x)");
        }
        if (row_weights && (activation != Act::kSwiglu || !weights || (dweights && !drow_weights))) {
          throw std::invalid_argument("moe_bwd: the weights in the activation (row_weights set) need SwiGLU (act 0), "
                                      "the weights, and drow_weights for dweights");
        }
        const auto mlp = experts_bwd_params(dy, x_perm, h, a, w13, w2, group_sizes, row_weights, da, dh, dx_perm, dw13,
                                            dw2, row_weights && dweights ? drow_weights : 0, rows, hidden, ffn, E, dt,
                                            workspace, ws_bytes, device, activation);
        const size_t need =
            std::max({permute::permute_workspace_bytes(tokens * k, E), size_t(rows), mlp.need()});
        if (ws_bytes < need) return need;
        // x_perm, row_map and group_sizes as the forward wrote them (permute is deterministic: rows by expert, then
        // token, then slot; padding rows zero); the rows are copied only for dw13's product
        permute::permute_fwd({ptr<const void>(x), ptr<const int32_t>(indices), ptr<void>(x_perm),
                              ptr<int32_t>(row_map), ptr<int32_t>(group_sizes), ptr<void>(workspace), tokens, k,
                              dw13 ? hidden * dtype_size(dt) : 0, E, align},
                             stream(s));
        if (row_weights) {
          permute::slot_values_to_rows(ptr<const int32_t>(row_map), ptr<const float>(weights), tokens * k, rows,
                                       ptr<float>(row_weights), stream(s));
        }
        auto* row_mask = ptr<uint8_t>(workspace);  // zero-filled scratch of unpermute_bwd, done before the GEMMs
        check_cuda(cudaMemsetAsync(row_mask, 0, size_t(rows), stream(s)), "moe_bwd");
        // with the weights in the activation: dy the plain gather of dout, their gradient from the activation's
        // backward
        permute::unpermute_bwd({ptr<const void>(dout), row_weights ? nullptr : ptr<const void>(y),
                                ptr<const int32_t>(row_map), row_weights ? nullptr : ptr<const float>(weights),
                                ptr<void>(dy), row_weights ? nullptr : ptr<float>(dweights), row_mask, tokens, k,
                                hidden, rows, dt},
                               stream(s));
        mlp.run_head(stream(s));
        if (row_weights && dweights) {
          permute::rows_to_slot_values(ptr<const int32_t>(row_map), ptr<const float>(drow_weights), tokens * k, rows,
                                       ptr<float>(dweights), stream(s));
        }
        if (dx) {
          gemm::grouped_mm(mlp.dx, stream(s));
          permute::unpermute_fwd({ptr<const void>(dx_perm), ptr<const int32_t>(row_map), nullptr, ptr<void>(dx),
                                  tokens, k, hidden, rows, dt},
                                 stream(s));
        }
        if (dw13) gemm::grouped_mm(mlp.dw13, stream(s));
        return 0;
      });

  // The gather-fused expert MLP (ops/expert_mlp.py): out [T, H] = sum over each token's slots of
  // swiglu(x[t] W13_e^T, row_weight) W2_e^T, read straight from the tokens. x [T, H], row_map [T, k] (permute's,
  // R rows), w13 [E, 2F, H], w2 [E, H, F]. Writes row_token [R] (each row's token, -1: padding) and h [R, 2F]
  // for the backward; a [R, F] and y [R, H] are scratch. No permuted copy of x is written. R > 0.
  m.def(
      "expert_mlp_fwd",
      [](uintptr_t x, uintptr_t row_map, uintptr_t group_sizes, uintptr_t w13, uintptr_t w2, uintptr_t row_weights,
         uintptr_t row_token, uintptr_t h, uintptr_t a, uintptr_t y, uintptr_t out, int64_t tokens, int64_t k,
         int64_t rows, int64_t hidden, int64_t ffn, int32_t E, int32_t dtype, uintptr_t workspace, size_t ws_bytes,
         int device, uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        auto up = gemm_params(GemmOp::kFwd, x, w13, h, group_sizes, E, rows, 2 * ffn, hidden, dt, workspace, ws_bytes,
                              device);
        up.a_rows = ptr<const int32_t>(row_token);
        up.gather_rows = tokens;
        up.act = ptr<void>(a);
        up.act_weights = ptr<const float>(row_weights);
        auto down = gemm_params(GemmOp::kFwd, a, w2, y, group_sizes, E, rows, hidden, ffn, dt, workspace, ws_bytes,
                                device);
        const size_t need = need_of({&up, &down});
        if (ws_bytes < need) return need;
        permute::rows_to_tokens(ptr<const int32_t>(row_map), tokens, k, rows, ptr<int32_t>(row_token), stream(s));
        gemm::grouped_mm(up, stream(s));
        gemm::grouped_mm(down, stream(s));
        permute::unpermute_fwd({ptr<const void>(y), ptr<const int32_t>(row_map), nullptr, ptr<void>(out), tokens, k,
                                hidden, rows, dt},
                               stream(s));
        return 0;
      });
  // Its backward: dout [T, H] -> dx [T, H], dw13, dw2, drow_weights [R] fp32 (each only when its pointer is
  // non-zero). dout's rows are gathered into both products of the down projection, x's into the up
  // projection's wgrad; a [R, F] (recomputed from h), da [R, F], dh [R, 2F] and dxp [R, H] are scratch.
  m.def(
      "expert_mlp_bwd",
      [](uintptr_t dout, uintptr_t x, uintptr_t row_token, uintptr_t row_map, uintptr_t h, uintptr_t w13, uintptr_t w2,
         uintptr_t group_sizes, uintptr_t row_weights, uintptr_t a, uintptr_t da, uintptr_t dh, uintptr_t dxp,
         uintptr_t dx, uintptr_t dw13, uintptr_t dw2, uintptr_t drow_weights, int64_t tokens, int64_t k, int64_t rows,
         int64_t hidden, int64_t ffn, int32_t E, int32_t dtype, uintptr_t workspace, size_t ws_bytes, int device,
         uintptr_t s) -> size_t {
        DeviceGuard guard(device);
        const DType dt = DType(dtype);
        const auto* tok = ptr<const int32_t>(row_token);
        auto da_p = gemm_params(GemmOp::kDgrad, dout, w2, da, group_sizes, E, rows, hidden, ffn, dt, workspace,
                                ws_bytes, device);
        da_p.a_rows = tok;
        da_p.gather_rows = tokens;
        auto dw2_p = gemm_params(GemmOp::kWgrad, dout, a, dw2, group_sizes, E, rows, hidden, ffn, dt, workspace,
                                 ws_bytes, device);
        dw2_p.a_rows = tok;
        dw2_p.gather_rows = tokens;
        auto dx_p = gemm_params(GemmOp::kDgrad, dh, w13, dxp, group_sizes, E, rows, 2 * ffn, hidden, dt, workspace,
                                ws_bytes, device);
        auto dw13_p = gemm_params(GemmOp::kWgrad, dh, x, dw13, group_sizes, E, rows, 2 * ffn, hidden, dt, workspace,
                                  ws_bytes, device);
        dw13_p.b_rows = tok;
        dw13_p.gather_rows = tokens;
        const size_t need = need_of({&da_p, &dw2_p, &dx_p, &dw13_p});
        if (ws_bytes < need) return need;
        gemm::grouped_mm(da_p, stream(s));
        // dh, the routing weights' gradient and (for dw2) the activation again, from one read of h
        activation::swiglu_bwd({ptr<const void>(da), ptr<const void>(h), ptr<const float>(row_weights), ptr<void>(dh),
                                ptr<float>(drow_weights), rows, ffn, dt, dw2 ? ptr<void>(a) : nullptr},
                               stream(s));
        if (dw2) gemm::grouped_mm(dw2_p, stream(s));
        if (dx) {
          gemm::grouped_mm(dx_p, stream(s));
          permute::unpermute_fwd({ptr<const void>(dxp), ptr<const int32_t>(row_map), nullptr, ptr<void>(dx), tokens,
                                  k, hidden, rows, dt},
                                 stream(s));
        }
        if (dw13) gemm::grouped_mm(dw13_p, stream(s));
        return 0;
      });
}

}  // namespace moe::api
