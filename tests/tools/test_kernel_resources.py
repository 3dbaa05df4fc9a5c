"""scripts/kernel_resources.py names each CUTLASS instance's kernel by the instance, from the `NAME_instance` type
its symbol carries (several instances share a translation unit, so the source file cannot name them)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "kernel_resources.py"
_spec = importlib.util.spec_from_file_location("kernel_resources", _PATH)
kr = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("kernel_resources", kr)  # its dataclasses look their module up
_spec.loader.exec_module(kr)

# Shortened from the sm_100f build: c++filt leaves this symbol mangled; the namespace `sm100` ends in digits right
# before the name's length.
_MANGLED_SM100 = ("_ZN7cutlass13device_kernelIN3moe4gemm4sm905NamedINS_4gemm6kernel13GemmUniversalIvEENS2_5sm10054"
                  "wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1_instanceEEEEEvNT_6ParamsE")
_MANGLED_SM90 = ("_ZN7cutlass13device_kernelIN3moe4gemm4sm905NamedINS_4gemm6kernel13GemmUniversalIvEENS3_43"
                 "fwd_fp8_blockwise_128x128x128_c2x1_instanceEEEEEvNT_6ParamsE")
_DEMANGLED_PREPARE = ("void moe::gemm::sm90::prepare_sm90<moe::gemm::sm90::GroupedGemm<cutlass::bfloat16_t, "
                      "(moe::gemm::GemmOp)0, moe::gemm::sm90::Sm90Config<128, 256, 64, 2, 1, false>, "
                      "moe::gemm::sm90::fwd_bf16_coop_128x256x64_c2x1_instance>, cutlass::bfloat16_t, "
                      "(moe::gemm::GemmOp)0>(int)")


@pytest.mark.parametrize(("symbol", "name"), [
    (_MANGLED_SM100, "cutlass::device_kernel[wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1]"),
    (_MANGLED_SM90, "cutlass::device_kernel[fwd_fp8_blockwise_128x128x128_c2x1]"),
    (_DEMANGLED_PREPARE, "gemm::sm90::prepare_sm90[fwd_bf16_coop_128x256x64_c2x1]"),
    ("void moe::permute::(anonymous namespace)::copy_kernel<16>(int)", "permute::copy_kernel<16>"),
])
def test_kernels_are_named_by_their_instance(symbol, name):
    assert kr.short_name(symbol, "csrc/gemm/sm90/instances_bf16.cu") == name


def test_an_unnamed_cutlass_kernel_falls_back_to_its_source_file():
    symbol = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIvEEEEvNT_6ParamsE"
    assert kr.short_name(symbol, "/src/csrc/gemm/sm90/fwd_x.cu") == "cutlass::device_kernel[fwd_x]"
    # a length that does not end at `_instance` names nothing
    assert kr.instance_names("N3moe5sm10099fwd_x_instanceE") == []


def test_digits_inside_a_matched_name_start_no_other():
    # `14` inside the name, read as a length, would span `_c1x1_instance`
    assert kr.instance_names("N3moe4sm9021fwd_k14_c1x1_instanceE") == ["fwd_k14_c1x1"]
