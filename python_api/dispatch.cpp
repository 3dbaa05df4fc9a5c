#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatch/nvlink.h"
#include "permute/permute.h"
#include "registry.h"

namespace py = pybind11;

namespace moe::api {
namespace {

using dispatch::World;

World world(int32_t rank, int32_t ranks, uintptr_t bases) { return World{rank, ranks, ptr<const uint64_t>(bases)}; }

#ifdef CUDA_ON_CPU
[[noreturn]] void no_ipc() {
  throw std::runtime_error("CUDA IPC needs GPUs: the CPU-executed build runs the dispatch kernels on virtual ranks only");
}
#endif

// Peer memory: one cudaMalloc per region (an IPC handle names a whole allocation), its handle as bytes,
// and the mapping of another process's handle (peer access enabled lazily by the driver).
uintptr_t ipc_malloc(size_t bytes, int device) {
#ifdef CUDA_ON_CPU
  (void)bytes, (void)device;
  no_ipc();
#else
  DeviceGuard guard(device);
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc (nvlink dispatch buffer)");
  check_cuda(cudaMemset(p, 0, bytes), "cudaMemset (nvlink dispatch buffer)");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (nvlink dispatch buffer)");  // zeroed before peers map it
  return reinterpret_cast<uintptr_t>(p);
#endif
}

void ipc_free(uintptr_t p, int device) {
#ifdef CUDA_ON_CPU
  (void)p, (void)device;
#else
  DeviceGuard guard(device);
  cudaFree(reinterpret_cast<void*>(p));
#endif
}

py::bytes ipc_handle(uintptr_t p, int device) {
#ifdef CUDA_ON_CPU
  (void)p, (void)device;
  no_ipc();
#else
  DeviceGuard guard(device);
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(p)), "cudaIpcGetMemHandle");
  return py::bytes(h.reserved, sizeof(h.reserved));
#endif
}

uintptr_t ipc_open(py::bytes handle, int device) {
#ifdef CUDA_ON_CPU
  (void)handle, (void)device;
  no_ipc();
#else
  std::string s = handle;
  cudaIpcMemHandle_t h;
  if (s.size() != sizeof(h.reserved)) throw std::invalid_argument("ipc_open: the handle has the wrong size");
  std::memcpy(h.reserved, s.data(), sizeof(h.reserved));
  DeviceGuard guard(device);
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(p);
#endif
}

void ipc_close(uintptr_t p, int device) {
#ifdef CUDA_ON_CPU
  (void)p, (void)device;
#else
  DeviceGuard guard(device);
  cudaIpcCloseMemHandle(reinterpret_cast<void*>(p));
#endif
}

bool can_access_peer(int device, int peer) {
#ifdef CUDA_ON_CPU
  return device == peer;
#else
  if (device == peer) return true;
  int ok = 0;
  check_cuda(cudaDeviceCanAccessPeer(&ok, device, peer), "cudaDeviceCanAccessPeer");
  return ok != 0;
#endif
}

// The GPU's PCI bus id ("0000:1b:00.0"), the same in every process whatever CUDA_VISIBLE_DEVICES says.
std::string pci_bus_id(int device) {
#ifdef CUDA_ON_CPU
  (void)device;
  return "emulated";
#else
  char id[32] = {0};
  check_cuda(cudaDeviceGetPCIBusId(id, sizeof(id), device), "cudaDeviceGetPCIBusId");
  return std::string(id);
#endif
}

// This process's device index of the GPU with that bus id, -1 when it is not visible here.
int device_by_pci_bus_id(const std::string& id) {
#ifdef CUDA_ON_CPU
  return id == "emulated" ? 0 : -1;
#else
  int device = -1;
  if (cudaDeviceGetByPCIBusId(&device, id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
#endif
}

}  // namespace

void register_dispatch(py::module_& m) {
  m.attr("nvlink_max_ranks") = dispatch::kMaxRanks;
  m.attr("nvlink_header_bytes") = dispatch::header_bytes();
  m.def("nvlink_dispatch_layout",
        [](int32_t ranks, int64_t max_tokens, int64_t k, int64_t x_rows, int64_t row_bytes, int64_t scale_bytes) {
          const auto l = dispatch::dispatch_layout(ranks, max_tokens, k, x_rows, row_bytes, scale_bytes);
          py::dict d;
          d["src"] = l.src, d["idx"] = l.idx, d["w"] = l.w, d["x"] = l.x, d["scales"] = l.scales, d["bytes"] = l.bytes;
          return d;
        });
  m.def("nvlink_combine_bytes", &dispatch::combine_bytes);
  m.def("nvlink_combine_floats_offset", &dispatch::combine_floats_offset);
  m.def("permute_starts_offset", &permute::permute_starts_offset);
  m.def(
      "nvlink_barrier",
      [](int32_t rank, int32_t ranks, uintptr_t bases, int mode, int device, uintptr_t s) {
        DeviceGuard guard(device);
        dispatch::barrier(world(rank, ranks, bases), mode, stream(s));
      },
      py::arg("rank"), py::arg("ranks"), py::arg("bases"), py::arg("mode"), py::arg("device"), py::arg("stream"));
  m.def(
      "nvlink_notify",
      [](int32_t rank, int32_t ranks, uintptr_t header_bases, uintptr_t indices, int64_t num_tokens, int64_t k,
         int32_t local_experts, uintptr_t send_token, uintptr_t send_slot, int device, uintptr_t s) {
        DeviceGuard guard(device);
        dispatch::NotifyParams p{world(rank, ranks, header_bases), ptr<const int32_t>(indices), num_tokens, k,
                                 local_experts, ptr<int32_t>(send_token), ptr<int32_t>(send_slot)};
        dispatch::notify(p, stream(s));
      },
      py::arg("rank"), py::arg("ranks"), py::arg("header_bases"), py::arg("indices"), py::arg("num_tokens"),
      py::arg("k"), py::arg("local_experts"), py::arg("send_token"), py::arg("send_slot"), py::arg("device"),
      py::arg("stream"));
  m.def(
      "nvlink_send",
      [](int32_t rank, int32_t ranks, uintptr_t header_bases, uintptr_t data_bases, uintptr_t x, uintptr_t scales,
         uintptr_t weights, uintptr_t indices, uintptr_t send_token, uintptr_t send_slot, uintptr_t source_rows,
         int64_t num_tokens, int64_t k, int64_t row_bytes, int64_t scale_bytes, int64_t max_tokens, int64_t x_rows,
         int64_t capacity, int32_t local_experts, int32_t num_sms, int device, uintptr_t s) {
        DeviceGuard guard(device);
        dispatch::SendParams p{};
        p.header = world(rank, ranks, header_bases);
        p.data = world(rank, ranks, data_bases);
        p.layout = dispatch::dispatch_layout(ranks, max_tokens, k, x_rows, row_bytes, scale_bytes);
        p.x = ptr<const void>(x);
        p.scales = ptr<const void>(scales);
        p.weights = ptr<const float>(weights);
        p.indices = ptr<const int32_t>(indices);
        p.send_token = ptr<const int32_t>(send_token);
        p.send_slot = ptr<const int32_t>(send_slot);
        p.source_rows = ptr<int32_t>(source_rows);
        p.num_tokens = num_tokens, p.k = k, p.row_bytes = row_bytes, p.scale_bytes = scale_bytes;
        p.max_tokens = max_tokens, p.x_rows = x_rows, p.capacity = capacity;
        p.local_experts = local_experts, p.num_sms = num_sms;
        dispatch::send(p, stream(s));
      },
      py::arg("rank"), py::arg("ranks"), py::arg("header_bases"), py::arg("data_bases"), py::arg("x"),
      py::arg("scales"), py::arg("weights"), py::arg("indices"), py::arg("send_token"), py::arg("send_slot"),
      py::arg("source_rows"), py::arg("num_tokens"), py::arg("k"), py::arg("row_bytes"), py::arg("scale_bytes"),
      py::arg("max_tokens"), py::arg("x_rows"), py::arg("capacity"), py::arg("local_experts"), py::arg("num_sms"),
      py::arg("device"), py::arg("stream"));
  m.def(
      "nvlink_prepare",
      [](int32_t rank, int32_t ranks, uintptr_t header_bases, uintptr_t idx, int64_t rows, int64_t k,
         uintptr_t num_received, int device, uintptr_t s) {
        DeviceGuard guard(device);
        dispatch::PrepareParams p{world(rank, ranks, header_bases), ptr<int32_t>(idx), rows, k,
                                  ptr<int32_t>(num_received)};
        dispatch::prepare(p, stream(s));
      },
      py::arg("rank"), py::arg("ranks"), py::arg("header_bases"), py::arg("idx"), py::arg("rows"), py::arg("k"),
      py::arg("num_received"), py::arg("device"), py::arg("stream"));
  m.def(
      "nvlink_layout_meta",
      [](uintptr_t num_received, uintptr_t src, uintptr_t idx, uintptr_t w, uintptr_t scales, uintptr_t row_map,
         uintptr_t handle_src, uintptr_t row_weights, uintptr_t local_indices, uintptr_t grouped_scales, int64_t rows,
         int64_t k, int64_t scale_bytes, int device, uintptr_t s) {
        DeviceGuard guard(device);
        dispatch::LayoutParams p{ptr<const int32_t>(num_received), ptr<const int32_t>(src), ptr<const int32_t>(idx),
                                 ptr<const float>(w), ptr<const void>(scales), ptr<const int32_t>(row_map),
                                 ptr<int32_t>(handle_src), ptr<float>(row_weights), ptr<int32_t>(local_indices),
                                 ptr<void>(grouped_scales), rows, k, scale_bytes};
        dispatch::layout_meta(p, stream(s));
      },
      py::arg("num_received"), py::arg("src"), py::arg("idx"), py::arg("w"), py::arg("scales"), py::arg("row_map"),
      py::arg("handle_src"), py::arg("row_weights"), py::arg("local_indices"), py::arg("grouped_scales"),
      py::arg("rows"), py::arg("k"), py::arg("scale_bytes"), py::arg("device"), py::arg("stream"));
  auto move = [](bool pull) {
    return [pull](int32_t rank, int32_t ranks, uintptr_t data_bases, uintptr_t num_received, uintptr_t src,
                  uintptr_t row_map, uintptr_t rows, uintptr_t floats, int64_t received_rows, int64_t k,
                  int64_t row_bytes, int64_t max_tokens, int32_t num_sms, uintptr_t starts, uintptr_t totals,
                  uintptr_t group_sizes, int32_t local_experts, int device, uintptr_t s) {
      DeviceGuard guard(device);
      dispatch::MoveParams p{world(rank, ranks, data_bases), ptr<const int32_t>(num_received),
                             ptr<const int32_t>(src),        ptr<const int32_t>(row_map),
                             ptr<void>(rows),                ptr<const float>(floats),
                             received_rows,                  k,
                             row_bytes,                      max_tokens,
                             num_sms,                        ptr<const int32_t>(starts),
                             ptr<const int32_t>(totals),     ptr<const int32_t>(group_sizes),
                             local_experts};
      if (pull) dispatch::pull(p, stream(s));
      else dispatch::push(p, stream(s));
    };
  };
  for (const char* name : {"nvlink_push", "nvlink_pull"}) {
    m.def(name, move(std::string(name) == "nvlink_pull"), py::arg("rank"), py::arg("ranks"), py::arg("data_bases"),
          py::arg("num_received"), py::arg("src"), py::arg("row_map"), py::arg("rows"), py::arg("floats"),
          py::arg("received_rows"), py::arg("k"), py::arg("row_bytes"), py::arg("max_tokens"), py::arg("num_sms"),
          py::arg("starts"), py::arg("totals"), py::arg("group_sizes"), py::arg("local_experts"), py::arg("device"),
          py::arg("stream"));
  }
  m.def("ipc_malloc", &ipc_malloc, py::arg("bytes"), py::arg("device"));
  m.def("ipc_free", &ipc_free, py::arg("ptr"), py::arg("device"));
  m.def("ipc_handle", &ipc_handle, py::arg("ptr"), py::arg("device"));
  m.def("ipc_open", &ipc_open, py::arg("handle"), py::arg("device"));
  m.def("ipc_close", &ipc_close, py::arg("ptr"), py::arg("device"));
  m.def("can_access_peer", &can_access_peer, py::arg("device"), py::arg("peer"));
  m.def("pci_bus_id", &pci_bus_id, py::arg("device"));
  m.def("device_by_pci_bus_id", &device_by_pci_bus_id, py::arg("bus_id"));
}

}  // namespace moe::api
