#include "gemm/grouped_mm.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "gemm/sm90_kernels.h"

#include "registry.h"

namespace py = pybind11;

namespace moe::api {

namespace {

gemm::GroupedParams make(int32_t op, uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_sizes, int32_t E,
                         int64_t M, int64_t N, int64_t K, int32_t dtype, uintptr_t workspace, size_t workspace_bytes,
                         int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out, int32_t kernel,
                         int32_t raster, uintptr_t a_global = 0, uintptr_t b_global = 0, int32_t portable = -1) {
  auto p = gemm::GroupedParams{gemm::GemmOp(op),         ptr<const void>(a), ptr<const void>(b), ptr<void>(d),
                             ptr<const int32_t>(group_sizes), E,         M,                  N,
                             K,                        DType(dtype),       ptr<void>(workspace), workspace_bytes,
                             device,                   ptr<const float>(sfa), ptr<const float>(sfb)};
  p.fp8_wgrad_out = DType(fp8_wgrad_out);
  p.kernel = kernel;
  p.raster = raster;
  p.a_global = ptr<const float>(a_global);
  p.b_global = ptr<const float>(b_global);
  p.portable = portable;
  return p;
}

py::dict spec_dict(const gemm::KernelSpec& k) {
  py::dict d;
  d["name"] = k.name;
  d["op"] = int(k.op);
  d["dtype"] = int(k.dtype);
  d["out"] = int(k.out);
  d["pingpong"] = k.pingpong;
  d["tile"] = py::make_tuple(k.tile_m, k.tile_n, k.tile_k);
  d["cluster"] = py::make_tuple(k.cluster_m, k.cluster_n);
  return d;
}

py::tuple choice_tuple(const gemm::Choice& c) {
  return py::make_tuple(gemm::kSm90Kernels[c.kernel].name, int(c.raster), c.table_row);
}

}  // namespace

void register_gemm(py::module_& m) {
  m.attr("grouped_mm_max_groups") = gemm::kMaxGroups;
  m.attr("grouped_mm_has_sm90") = gemm::sm90::compiled();
  m.attr("grouped_mm_has_sm100") = gemm::sm100::compiled();
  m.def("grouped_mm_sm100_enabled", &gemm::sm100::enabled,
        "Whether a 10.0 / 10.3 GPU runs the sm_100f instances: built, and MOE_KERNELS_SM100_CUTLASS=1 when first "
        "asked (the choice the kernels' dispatch makes; read once per process)");
  m.def("grouped_mm_portable_mma_enabled", &gemm::portable_mma_enabled,
        "Whether the tensor-core portable kernels are the default where they fit (bf16, fp16 on sm_80+; E4M3 "
        "blockwise fwd and wgrad on 8.9+; no CUTLASS kernel for the problem): MOE_KERNELS_PORTABLE_MMA=1 when first "
        "asked (read once per process); else the CUDA-core portable kernel (FP8: the Python layer dequantizes)");
  m.def("grouped_mm_gather_enabled", &gemm::sm90::gather_enabled,
        "Whether a 9.0 GPU runs the gathered products (expert_mlp) on the sm_90a gather kernels: built, and "
        "MOE_KERNELS_GATHER_CUTLASS=1 when first asked (read once per process); else the portable kernel");
  m.def(
      "grouped_mm_path",
      [](int32_t op, int32_t dtype, int32_t num_groups, int64_t M, int64_t N, int64_t K, uintptr_t a, uintptr_t b,
         uintptr_t d, int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out, int32_t kernel, int32_t raster,
         uintptr_t a_global, uintptr_t b_global, int32_t portable, uintptr_t a_rows, uintptr_t b_rows,
         uintptr_t act) {
        DeviceGuard guard(device);
        auto p = make(op, a, b, d, 0, num_groups, M, N, K, dtype, 0, 0, device, sfa, sfb, fp8_wgrad_out, kernel, raster,
                      a_global, b_global, portable);
        p.a_rows = ptr<const int32_t>(a_rows);
        p.b_rows = ptr<const int32_t>(b_rows);
        p.act = ptr<void>(act);
        return int(gemm::choose_path(p));
      },
      "0 = portable kernel, 1 = sm_90a ping-pong, 2 = sm_90a cooperative, 3 = sm_90a fp8 blockwise, 4 = sm_100f "
      "(bf16, opted in: MOE_KERNELS_SM100_CUTLASS=1), 5 = sm_100f fp8 blockwise, 6 = sm_90a gather (expert_mlp's "
      "gathered products, opted in: MOE_KERNELS_GATHER_CUTLASS=1), 7 = sm_100f nvfp4 block-scaled (opted in: "
      "MOE_KERNELS_SM100_CUTLASS=1), 8 = the portable kernel on tensor cores (bf16, fp16 on sm_80+; E4M3 "
      "blockwise fwd and wgrad on 8.9+: portable=1, or MOE_KERNELS_PORTABLE_MMA=1). a_rows, b_rows, act: the addresses of a gathered product's row indices and the "
      "SwiGLU epilogue's output (non-zero: that fusion)",
      py::arg("op"),
      py::arg("dtype"), py::arg("num_groups"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a"), py::arg("b"),
      py::arg("d"), py::arg("device"), py::arg("sfa") = 0, py::arg("sfb") = 0, py::arg("fp8_wgrad_out") = 0,
      py::arg("kernel") = -1, py::arg("raster") = -1, py::arg("a_global") = 0, py::arg("b_global") = 0,
      py::arg("portable") = -1, py::arg("a_rows") = 0, py::arg("b_rows") = 0, py::arg("act") = 0);
  m.def(
      "grouped_mm_workspace_bytes",
      [](int32_t op, int32_t dtype, int32_t num_groups, int64_t M, int64_t N, int64_t K, uintptr_t a, uintptr_t b,
         uintptr_t d, int device, uintptr_t sfa, uintptr_t sfb, int32_t fp8_wgrad_out, int32_t kernel, int32_t raster,
         uintptr_t a_global, uintptr_t b_global, int32_t portable) {
        DeviceGuard guard(device);
        return gemm::grouped_workspace_bytes(make(op, a, b, d, 0, num_groups, M, N, K, dtype, 0, 0, device, sfa, sfb,
                                                  fp8_wgrad_out, kernel, raster, a_global, b_global, portable));
      },
      py::arg("op"), py::arg("dtype"), py::arg("num_groups"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a"),
      py::arg("b"), py::arg("d"), py::arg("device"), py::arg("sfa") = 0, py::arg("sfb") = 0,
      py::arg("fp8_wgrad_out") = 0, py::arg("kernel") = -1, py::arg("raster") = -1, py::arg("a_global") = 0,
      py::arg("b_global") = 0, py::arg("portable") = -1);
  m.def(
      "grouped_mm",
      [](int32_t op, uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_sizes, int32_t num_groups, int64_t M,
         int64_t N, int64_t K, int32_t dtype, uintptr_t workspace, size_t workspace_bytes, int device, uintptr_t s,
         uintptr_t sfa, uintptr_t sfb, int32_t group_align, int32_t fp8_wgrad_out, int32_t kernel, int32_t raster,
         bool accumulate, int32_t group_order, uintptr_t a_global, uintptr_t b_global, int32_t portable) {
        DeviceGuard guard(device);
        auto p = make(op, a, b, d, group_sizes, num_groups, M, N, K, dtype, workspace, workspace_bytes, device, sfa, sfb,
                      fp8_wgrad_out, kernel, raster, a_global, b_global, portable);
        p.group_align = group_align;
        p.accumulate = accumulate;
        p.group_order = group_order;
        gemm::grouped_mm(p, stream(s));
      },
      "group_align (wgrad): groups whose rows do not start and end on multiples of it get NaN; 0: any. "
      "fp8_wgrad_out (FP8 wgrad): the output's dtype code, float32 (0) or bfloat16 (2). kernel, raster (sm_90a): "
      "the instance (an index into grouped_mm_sm90_kernels()) and raster order (0 along M, 1 along N) to run; "
      "-1: the tuning table's choice. accumulate (wgrad with a float32 output): d += the product, empty groups "
      "keep d. group_order: the order the CUTLASS schedulers visit the groups, 1 largest first (sizes read on the "
      "device), 0 expert order, -1 the default (largest first for wgrad); the output is the same. a_global, "
      "b_global (nvfp4, dtype 6): the operands' fp32 global scales on the device. portable: 0 the CUDA-core portable "
      "kernel, 1 the tensor-core one (bf16, fp16, sm_80+), -1 the default choice",
      py::arg("op"), py::arg("a"), py::arg("b"), py::arg("d"), py::arg("group_sizes"), py::arg("num_groups"),
      py::arg("M"), py::arg("N"), py::arg("K"), py::arg("dtype"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("device"), py::arg("stream"), py::arg("sfa") = 0, py::arg("sfb") = 0, py::arg("group_align") = 0,
      py::arg("fp8_wgrad_out") = 0, py::arg("kernel") = -1, py::arg("raster") = -1, py::arg("accumulate") = false,
      py::arg("group_order") = -1, py::arg("a_global") = 0, py::arg("b_global") = 0, py::arg("portable") = -1);
  m.def("grouped_mm_nvfp4_scale_atoms", &gemm::nvfp4_scale_atoms,
        "Atoms (512 bytes each) of NVFP4 scales in CUTLASS's blocked layout for atom_rows rows of 128 and K "
        "elements", py::arg("atom_rows"), py::arg("K"));
  m.def(
      "grouped_mm_nvfp4_blocked_scales",
      [](uintptr_t src, uintptr_t dst, uintptr_t group_sizes, int32_t num_groups, int64_t M, int64_t N, int64_t K,
         uintptr_t workspace, size_t workspace_bytes, int device, uintptr_t s) {
        DeviceGuard guard(device);
        if (group_sizes == 0) {
          gemm::nvfp4_blocked_scales(ptr<const uint8_t>(src), ptr<uint8_t>(dst), num_groups, N, K, stream(s));
          return;
        }
        auto p = make(0, 0, 0, 0, group_sizes, num_groups, M, N, K, int32_t(DType::kFloat4E2M1), workspace,
                      workspace_bytes, device, src, 0, 0, -1, -1);
        gemm::nvfp4_blocked_activation_scales(p, ptr<uint8_t>(dst), stream(s));
      },
      "NVFP4 block scales (E4M3 bytes, row-major [rows, K / 16]) into the blocked layout the sm_100f NVFP4 kernel "
      "reads, by the kernel grouped_mm runs: with group_sizes, the activations' rows in groups (M rows, each group "
      "padded to 128; workspace as grouped_mm_workspace_bytes sizes an fp32 problem); without, num_groups experts "
      "of N rows",
      py::arg("src"), py::arg("dst"), py::arg("group_sizes"), py::arg("num_groups"), py::arg("M"), py::arg("N"),
      py::arg("K"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("device"), py::arg("stream"));
  m.attr("grouped_mm_max_ordered_groups") = gemm::kMaxOrderedGroups;
  m.def(
      "grouped_mm_visit_order",
      [](int32_t op, uintptr_t group_sizes, int32_t num_groups, int64_t M, int64_t N, int64_t K, int32_t dtype,
         uintptr_t workspace, size_t workspace_bytes, int device, uintptr_t s, uintptr_t order, int32_t group_order) {
        DeviceGuard guard(device);
        auto p = make(op, 0, 0, 0, group_sizes, num_groups, M, N, K, dtype, workspace, workspace_bytes, device, 0, 0, 0,
                      -1, -1);
        p.group_order = group_order;
        gemm::group_visit_order(p, ptr<int32_t>(order), stream(s));
      },
      "Writes order[num_groups] (int32): the order in which grouped_mm's CUTLASS schedulers visit the groups for "
      "these sizes (order[s] = the group visited s-th), from grouped_mm's own prepare kernel; workspace as "
      "grouped_mm_workspace_bytes sizes it. Expert order where group_order resolves to it (or past "
      "grouped_mm_max_ordered_groups groups)",
      py::arg("op"), py::arg("group_sizes"), py::arg("num_groups"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("dtype"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("device"), py::arg("stream"),
      py::arg("order"), py::arg("group_order") = -1);

  // The sm_90a instances and their choice (csrc/gemm/sm90_kernels.h); no GPU needed.
  m.def(
      "grouped_mm_sm90_kernels",
      [] {
        py::list out;
        for (int i = 0; i < gemm::kNumSm90Kernels; ++i) out.append(spec_dict(gemm::kSm90Kernels[i]));
        return out;
      },
      "The sm_90a grouped GEMM instances, in kernel-id order: name, op, dtype and out codes, schedule, tile, cluster");
  m.def(
      "grouped_mm_sm90_table",
      [] {
        py::list out;
        for (int i = 0; i < gemm::kSm90TableRows; ++i) {
          const auto& r = gemm::kSm90Table[i];
          py::dict d;
          d["op"] = int(r.op);
          d["dtype"] = int(r.dtype);
          d["out"] = int(r.out);
          d["E"] = r.E;
          d["M"] = r.M;
          d["N"] = r.N;
          d["K"] = r.K;
          d["kernel"] = r.kernel;
          d["raster"] = int(r.raster);
          d["tuned"] = r.tuned;
          out.append(d);
        }
        return out;
      },
      "The tuning table compiled into this build (csrc/gemm/sm90_table.h)");
  m.def(
      "grouped_mm_sm90_choice",
      [](int32_t op, int32_t dtype, int32_t out, int32_t E, int64_t M, int64_t N, int64_t K) {
        return choice_tuple(gemm::choose_sm90(gemm::GemmOp(op), DType(dtype), DType(out), E, M, N, K));
      },
      "(kernel name, raster, table row or -1 for the rule) the table chooses for this problem", py::arg("op"),
      py::arg("dtype"), py::arg("out"), py::arg("E"), py::arg("M"), py::arg("N"), py::arg("K"));
  m.def(
      "grouped_mm_sm90_rule",
      [](int32_t op, int32_t dtype, int32_t out, int32_t E, int64_t M, int64_t N, int64_t K) {
        return choice_tuple(gemm::rule_sm90(gemm::GemmOp(op), DType(dtype), DType(out), E, M, N, K));
      },
      "(kernel name, raster, -1): the rule's choice, used where the table holds no row for the shape",
      py::arg("op"), py::arg("dtype"), py::arg("out"), py::arg("E"), py::arg("M"), py::arg("N"), py::arg("K"));
}

}  // namespace moe::api
