// The NVFP4 grouped GEMM instance for sm_100f, listed in sm100_dispatch.cu.
#include "gemm/sm100/nvfp4_sm100.cuh"

namespace moe::gemm::sm100 {

MOE_NVFP4_SM100_INSTANCE(fwd_nvfp4_1sm_128x256x256_c1x1, 128, 256, 256)

}  // namespace moe::gemm::sm100
