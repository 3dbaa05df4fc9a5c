"""Kernel resource report without a GPU: registers, local memory (spills), shared memory and theoretical
occupancy of every kernel in the built `moe_kernels._C`, plus SASS checks, read from the binary with
cuobjdump (the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels, or the CUDA toolkit's).

    python scripts/kernel_resources.py [--so PATH] [--arch sm_90a] [--launch-log FILE] [--out FILE]

The extension holds machine code for several architectures (the default build: sm_80, sm_90a, sm_100,
sm_120); the report reads one of them, `--arch` (default sm_90a, the H100/H200 whose per-SM limits the
occupancy column uses).

Fails (exit 1) when a kernel uses local memory (register spills or a local array: slow on every
launch) and is not listed in ACCEPTED_LOCAL with a reason, or when a SASS check fails. Occupancy needs
the block size: `__launch_bounds__` gives it where present; otherwise `--launch-log`, the launch
geometry the CPU-executed tests recorded (MOE_KERNELS_EMU_LAUNCH_LOG=FILE), gives the largest block
each kernel was launched with.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# sm_90 (H100/H200) per-SM limits.
SM_REGS, SM_SMEM, SM_WARPS, SM_BLOCKS, RESERVED_SMEM = 65536, 233472, 64, 32, 1024
REG_UNIT = 256  # registers are allocated per warp in units of 256

# Kernels allowed to use local memory, with the reason (ptxas -v: bytes of spill stores / loads).
ACCEPTED_LOCAL: dict[str, str] = {
    "gemm::prepare_kernel": "one block per grouped GEMM call (group shapes and tile offsets): 1024 threads cap "
                            "registers at 64, about 420 B of spills once per call, not per tile",
    "permute::copy_kernel<1>": "the 1-byte-vector path, only for rows of an odd number of bytes (fp8/uint8 "
                               "payloads with odd H); 12 B of spills",
    **{f"router::fused_fwd_kernel<{t}, 0>": "shared-memory rows (more than 256 experts): the last block's finish "
                                             "only (after the ticket; the chunk loop keeps everything in registers): "
                                             "__launch_bounds__(256, 4) holds the kernel at 64 registers, and the "
                                             "finish's loads in flight spill 20 B, once a launch"
       for t in ("float", "__nv_bfloat16", "__half")},
    **{f"router::fused_fwd_kernel<{t}, {n}>": "register rows (up to 256 experts): __launch_bounds__(256, 3) gives 80 "
                                               "registers; 4 B of spill stores and 16 B of loads, in the last block's "
                                               "finish"
       for t in ("float", "__nv_bfloat16", "__half") for n in (1, 2, 4, 8)},
    "dispatch::barrier_kernel": "printf's 16 B of arguments, on the path that reports a barrier timeout before "
                                "trapping; the polling loop itself keeps everything in registers",
    # The FP8 tensor-core portable GEMM (csrc/gemm/portable_mma_fp8.cuh) in this report's sm_90a code: there ptxas
    # lowers E4M3 mma.sync to f16 conversions and the f16 instruction, whose extra registers beside the two
    # accumulator sets spill a little; 8.9 and 12.x run the native instruction without spills (FP8_NATIVE_CHECKS).
    **{f"gemm::mma::mma_fp8_kernel<(gemm::GemmOp){op}, {t}>":
           "sm_90a only (8.9 and 12.x: none, checked below): E4M3 mma.sync lowered to f16 conversions + HMMA, 24-160 B "
           "of spill stores and 100-160 B of loads per thread (sm_100: 32-96 B); on 9.0 the kernel runs only what the "
           "CUTLASS FP8 kernels do not take (opt-in)"
       for op, t in ((0, "__nv_bfloat16"), (2, "__nv_bfloat16"), (2, "float"))},
    # sm_100f (opt-in, not yet run on a Blackwell GPU): CUTLASS's 1-SM blockwise mainloop with a scale per row
    # and per column (the tokens' 1x128 blocks on both operands) spills in ptxas; the forward (a scale per
    # 128x128 weight tile) does not. To be measured before these are turned on by default.
    "cutlass::device_kernel[wgrad_fp8_blockwise_1sm_128x128x128_c1x1]":
        "sm_100f FP8 wgrad, per-row and per-column scales: 384 B of spills (ptxas), opt-in, unmeasured",
    "cutlass::device_kernel[wgrad_fp8_blockwise_bf16_1sm_128x128x128_c1x1]":
        "sm_100f FP8 wgrad (bf16 out), per-row and per-column scales: 448 B of spills (ptxas), opt-in, unmeasured",
}

# SASS checks: (kernel name pattern, instruction pattern, why).
SASS_CHECKS = (
    (r"permute::.*copy_kernel<16>", r"LDG\.E\.128", "the permute copy loads 16-byte vectors"),
    (r"permute::.*copy_kernel<16>", r"STG\.E\.128", "the permute copy stores 16-byte vectors"),
    (r"dispatch::send_kernel<16>", r"LDG\.E\.128", "the NVLink send loads 16-byte vectors"),
    (r"dispatch::send_kernel<16>", r"STG\.E\.128", "the NVLink send stores 16-byte vectors (to peer memory)"),
    (r"dispatch::move_kernel<16, false>", r"STG\.E\.128", "the NVLink combine push stores 16-byte vectors"),
    (r"quant::.*tokens_quant_kernel", r"STG\.E\.128", "quantize_fp8_tokens stores 16 codes of a column at once"),
    (r"dispatch::.*barrier_kernel", r"STG\.E\.64\.STRONG\.SYS", "barrier signals are system-scope stores"),
    (r"dispatch::.*barrier_kernel", r"LDG\.E\.64\.STRONG\.SYS", "barrier polls are system-scope loads"),
    (r"dispatch::.*barrier_kernel", r"MEMBAR\.\w+\.SYS", "a system-scope fence orders the data before the signal"),
    # bf16 operands (an FP8 GEMM with a bf16 output, wgrad_fp8_blockwise_bf16_*, is the FP8 row's)
    (r"cutlass::device_kernel\[(?!\w*_fp8_)\w+_bf16_", r"HGMMA\.\w+\.F32\.BF16", "the bf16 CUTLASS GEMMs run on WGMMA"),
    (r"cutlass::device_kernel\[\w+_fp16_", r"HGMMA\.\w+\.F32 ", "the fp16 CUTLASS GEMMs run on WGMMA"),
    (r"cutlass::device_kernel\[\w+_fp8_", r"QGMMA\.\w+\.F32\.E4M3\.E4M3", "the FP8 CUTLASS GEMM runs on FP8 WGMMA"),
    # The portable grouped GEMM on tensor cores (csrc/gemm/portable_mma.cuh): mma.sync fed by ldmatrix.
    (r"gemm::mma::mma_kernel", r"HMMA\.16816\.F32", "the tensor-core portable GEMM runs mma.sync m16n8k16"),
    (r"gemm::mma::mma_kernel", r"LDSM\.16\.MT?88\.4", "the tensor-core portable GEMM reads fragments by ldmatrix"),
    (r"gemm::mma::mma_kernel", r"LDGSTS\.E\.BYPASS\.128", "the tensor-core portable GEMM copies 16-byte vectors to "
     "shared memory with cp.async"),
    # The gathered products (expert_mlp): cp.async of 16 bytes per row chunk into WGMMA's shared memory.
    (r"sm90::gather_gemm_kernel", r"HGMMA\.\w+\.F32\.BF16", "the gathered sm_90a GEMMs run on WGMMA"),
    (r"sm90::gather_gemm_kernel", r"LDGSTS\.E\.BYPASS\.128", "the gathered sm_90a GEMMs load 16-byte cp.async chunks"),
)


@dataclasses.dataclass
class Kernel:
    mangled: str
    source: str
    regs: int
    shared: int
    local: int
    stack: int
    name: str = ""
    max_threads: int | None = None
    launched: tuple[int, int] | None = None  # (threads, dynamic shared bytes) from the launch log

    @property
    def block(self) -> tuple[int, int] | None:
        if self.launched:
            return (min(self.launched[0], self.max_threads or 1024), self.launched[1])
        return (self.max_threads, 0) if self.max_threads else None

    def occupancy(self) -> tuple[float, str] | None:
        """(active warps / 64, the limiting resource) at the kernel's block size."""
        if self.block is None:
            return None
        threads, dyn = self.block
        warps = math.ceil(threads / 32)
        regs_per_warp = math.ceil(max(self.regs, 1) * 32 / REG_UNIT) * REG_UNIT
        limits = {
            "registers": SM_REGS // (regs_per_warp * warps),
            "shared memory": SM_SMEM // (self.shared + dyn + RESERVED_SMEM),
            "warps": SM_WARPS // warps,
            "blocks": SM_BLOCKS,
        }
        blocks = min(limits.values())
        return blocks * warps / SM_WARPS, min(limits, key=limits.get)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent / name)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        cands += sorted(Path(root).glob(f"*/bin/{name}"))
    for c in cands:
        if c.exists():
            return str(c)
    raise SystemExit(f"kernel_resources: {name} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def _run(cmd: list[str], env: dict | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"kernel_resources: {' '.join(cmd[:2])} failed: {r.stderr.strip()[:500]}")
    return r.stdout


def parse_resources(text: str) -> list[Kernel]:
    kernels, source = [], "?"
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*identifier = (.+)", line)
        if m:
            source = m.group(1).strip()
        m = re.match(r"\s*Function (\S+):", line)
        if m and i + 1 < len(lines):
            vals = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            kernels.append(Kernel(m.group(1), source, int(vals.get("REG", 0)), int(vals.get("SHARED", 0)),
                                  int(vals.get("LOCAL", 0)), int(vals.get("STACK", 0))))
    return kernels


def parse_max_threads(elf: str) -> dict[str, int]:
    """EIATTR_MAX_THREADS (from __launch_bounds__) per mangled kernel name."""
    out, current = {}, None
    lines = elf.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\.nv\.info\.(\S+)$", line.strip())
        if m:
            current = m.group(1)
        elif current and "EIATTR_MAX_THREADS" in line:
            for follow in lines[i + 1 : i + 3]:
                v = re.search(r"Value:\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)", follow)
                if v:
                    out[current] = math.prod(int(x, 16) for x in v.groups())
    return out


def parse_sass(sass: str) -> dict[str, str]:
    out, current, buf = {}, None, []
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if current:
                out[current] = out.get(current, "") + "\n".join(buf)
            current, buf = m.group(1), []
        elif current:
            buf.append(line)
    if current:
        out[current] = out.get(current, "") + "\n".join(buf)
    return out


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt or not names:
        return {n: n for n in names}
    r = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, r.stdout.splitlines())) if r.returncode == 0 else {n: n for n in names}


_DIGITS = re.compile(r"\d+")


def instance_names(name: str) -> list[str]:
    """The CUTLASS instances named in a kernel's symbol (`NAME_instance`), demangled (`::NAME_instance>`) or not
    (`<length>NAME_instance`: c++filt gives up on the longest CUTLASS symbols)."""
    found = re.findall(r"::(\w+?)_instance\b", name)
    if found:
        return found
    pos = 0
    while m := _DIGITS.search(name, pos):  # the length may follow other digits (`5sm10039wgrad_...`)
        pos = m.end()
        for i in range(len(m.group())):
            ident = name[m.end():m.end() + int(m.group()[i:])]
            if ident.endswith("_instance") and re.fullmatch(r"[A-Za-z_]\w*", ident):
                found.append(ident[: -len("_instance")])
                pos = m.end() + len(ident)  # past the name: digits inside it start no other
                break
    return found


def short_name(demangled: str, source: str) -> str:
    """`void moe::permute::(anonymous namespace)::copy_kernel<16>(...)` -> `permute::copy_kernel<16>`;
    a CUTLASS instance's kernel -> `cutlass::device_kernel[fwd_bf16_coop_256x128x64_c1x1]`, by the instance's name
    that its type carries (`NAME_instance`: several instances share a translation unit), and a kernel templated on
    an instance (its problem-list preparation) -> `gemm::sm90::prepare_sm90[fwd_bf16_coop_256x128x64_c1x1]`."""
    instance = instance_names(demangled)
    if "cutlass13device_kernel" in demangled or demangled.startswith("void cutlass::device_kernel"):
        return f"cutlass::device_kernel[{instance[0] if instance else Path(source).stem}]"
    name = demangled
    if name.startswith("void "):
        name = name[5:]
    depth, cut = 0, len(name)
    for i, c in enumerate(name):  # drop the parameter list
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not name.startswith("(anonymous", i):
            cut = i
            break
    name = name[:cut].replace("(anonymous namespace)::", "").replace("moe::", "").replace("cutlass::", "")
    if instance:
        name = f"{name.split('<')[0]}[{instance[0]}]"
    return name if len(name) <= 100 else name[:97] + "..."


def base_identifier(name: str) -> str:
    return re.split(r"[<(]", name)[0].split("::")[-1]


def read_launch_log(path: Path | None) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    if path is None or not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        key = base_identifier(parts[0])
        t, s = int(parts[1]), int(parts[2])
        old = out.get(key, (0, 0))
        out[key] = (max(old[0], t), max(old[1], s))
    return out


# The Blackwell CUTLASS instances (sm_100f cubins): each must hold tcgen05 MMAs, not a stub compiled without
# the family's MMA support. (kernel name pattern, instruction pattern, why)
SM100_CHECKS = (
    (r"cutlass::device_kernel\[\w+_bf16_2sm_", r"UTCHMMA\.2CTA", "the bf16 sm_100f GEMMs run 2-SM tcgen05 MMAs"),
    (r"cutlass::device_kernel\[\w+_fp8_blockwise_\w*1sm_", r"UTCQMMA", "the FP8 sm_100f GEMMs run tcgen05 FP8 MMAs"),
    (r"cutlass::device_kernel\[\w+_nvfp4_1sm_", r"UTCOMMA", "the NVFP4 sm_100f GEMM runs block-scaled tcgen05 MMAs"),
)


def blackwell_checks(cuobjdump: str, so: Path, env: dict) -> tuple[list[str], list[str]]:
    """Report rows and problems for the sm_100f CUTLASS instances, if the extension holds any."""
    arch = ["-arch", "sm_100f"]
    r = subprocess.run([cuobjdump, *arch, "--dump-resource-usage", str(so)], capture_output=True, text=True)
    kernels = parse_resources(r.stdout) if r.returncode == 0 else []
    cutlass = [k for k in kernels if "cutlass" in k.mangled or "device_kernel" in k.mangled]
    if not cutlass:
        return ["", "sm_100f CUTLASS instances: none in this build"], []
    sass = parse_sass(_run([cuobjdump, *arch, "-sass", str(so)], env=env))
    names = demangle([k.mangled for k in cutlass])
    for k in cutlass:
        k.name = short_name(names[k.mangled], k.source)
    accepted, problems = [], []
    for k in cutlass:
        if k.local + k.stack and k.name not in ACCEPTED_LOCAL:
            problems.append(f"{k.name} (sm_100f): {k.local + k.stack} bytes of local memory (register spills)")
        elif k.local + k.stack:
            accepted.append(f"- sm_100f `{k.name}`: {k.local + k.stack} B of local memory, accepted: "
                            f"{ACCEPTED_LOCAL[k.name]}")
    rows = ["", *accepted, "", "| SASS check (sm_100f) | kernels | result |", "|---|---|---|"]
    rows += sass_checks(SM100_CHECKS, cutlass, sass, problems)
    return rows, problems


# The FP8 tensor-core portable GEMM in sm_90a or sm_100 code, where ptxas lowers E4M3 mma.sync to f16 conversions and
# the f16 instruction (checked only when the report reads one of those: 8.9 and 12.x run it natively, below).
FP8_LOWERED_ARCHS = ("sm_90a", "sm_100")
FP8_LOWERED_CHECKS = (
    (r"gemm::mma::mma_fp8_kernel", r"F2FP\.F16\.E4M3\.UNPACK_B", "the FP8 portable GEMM's E4M3 mma.sync, via f16"),
    (r"gemm::mma::mma_fp8_kernel", r"HMMA\.16816\.F32", "the FP8 portable GEMM runs on tensor cores (f16 HMMA)"),
    (r"gemm::mma::mma_fp8_kernel", r"LDSM\.16\.M88\.4", "the FP8 portable GEMM reads fragments by ldmatrix"),
    (r"gemm::mma::mma_fp8_kernel", r"LDGSTS\.E\.BYPASS\.128", "the FP8 portable GEMM copies 16-byte vectors to shared "
     "memory with cp.async"),
)

# The FP8 tensor-core portable GEMM where E4M3 mma.sync is native (8.9: L4, L40S, RTX 40; 12.x: RTX 50): the
# instruction itself, and no local memory. The default build adds sm_89 code for its translation unit.
FP8_NATIVE_CHECKS = (
    (r"gemm::mma::mma_fp8_kernel", r"QMMA\.16832\.F32\.E4M3\.E4M3", "the FP8 portable GEMM runs E4M3 mma.sync"),
)


def native_fp8_checks(cuobjdump: str, so: Path, env: dict) -> tuple[list[str], list[str]]:
    """Report rows and problems for the FP8 tensor-core portable GEMM's sm_89 and sm_120 code, where built."""
    def fp8_kernels(arch: str) -> list[Kernel]:
        r = subprocess.run([cuobjdump, "-arch", arch, "--dump-resource-usage", str(so)], capture_output=True, text=True)
        return [k for k in (parse_resources(r.stdout) if r.returncode == 0 else []) if "mma_fp8_kernel" in k.mangled]

    rows, problems = [], []
    for arch in ("sm_89", "sm_120"):
        kernels = fp8_kernels(arch)
        if not kernels:
            rows += ["", f"FP8 tensor-core portable GEMM ({arch}): not in this build"]
            if arch == "sm_89" and fp8_kernels("sm_80"):  # CMakeLists.txt adds sm_89 wherever it builds sm_80
                problems.append("the FP8 tensor-core portable GEMM has sm_80 code but no sm_89 code (an 8.9 GPU "
                                "would load the sm_80 cubin, where the kernel is a trap)")
            continue
        names = demangle([k.mangled for k in kernels])
        for k in kernels:
            k.name = short_name(names[k.mangled], k.source)
            if k.local + k.stack:
                problems.append(f"{k.name} ({arch}): {k.local + k.stack} bytes of local memory (register spills)")
        # Only these kernels' SASS (-fun): the whole architecture's is most of the module's text.
        sass = parse_sass(_run([cuobjdump, "-arch", arch, "-sass", "-fun", ",".join(k.mangled for k in kernels), str(so)],
                               env=env))
        regs = ", ".join(f"{k.regs}" for k in sorted(kernels, key=lambda k: k.name))
        rows += ["", f"FP8 tensor-core portable GEMM ({arch}): {len(kernels)} kernels, registers {regs}, local memory "
                     f"{sum(k.local + k.stack for k in kernels)} B",
                 "", f"| SASS check ({arch}) | kernels | result |", "|---|---|---|"]
        rows += sass_checks(FP8_NATIVE_CHECKS, kernels, sass, problems)
    return rows, problems


def sass_checks(checks, kernels, sass: dict[str, str], problems: list[str]) -> list[str]:
    """One table row per (kernel pattern, instruction pattern, why): every matching kernel's SASS must hold the
    instruction, and some kernel must match; failures appended to `problems`."""
    rows = []
    for kpat, ipat, why in checks:
        matched = [k for k in kernels if re.search(kpat, k.name)]
        bad = [k.name for k in matched if not re.search(ipat, sass.get(k.mangled, ""))]
        ok = bool(matched) and not bad
        if not ok:
            problems.append(f"SASS: {why}: " + (f"missing in {bad}" if matched else f"no kernel matches {kpat!r}"))
        rows.append(f"| {why} (`{ipat}`) | {len(matched)} | {'ok' if ok else 'FAILED'} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--so", type=Path, help="the built extension (default: moe_kernels._C)")
    ap.add_argument("--arch", default="sm_90a", help="the architecture's machine code to read (default sm_90a)")
    ap.add_argument("--launch-log", type=Path, help="MOE_KERNELS_EMU_LAUNCH_LOG output of an emulated test run")
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    so = args.so
    if so is None:
        spec = importlib.util.find_spec("moe_kernels._C")
        if spec is None or spec.origin is None:
            raise SystemExit("kernel_resources: moe_kernels._C is not built")
        so = Path(spec.origin)
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")

    arch = ["-arch", args.arch]
    kernels = parse_resources(_run([cuobjdump, *arch, "--dump-resource-usage", str(so)]))
    if not kernels:
        raise SystemExit(f"kernel_resources: no {args.arch} kernels in {so}")
    # The dumps are independent cuobjdump runs of a minute or so each on a large module: two at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        sass_run = pool.submit(_run, [cuobjdump, *arch, "-sass", str(so)], env)
        elf_run = pool.submit(_run, [cuobjdump, *arch, "-elf", str(so)])
        blackwell_run = pool.submit(blackwell_checks, cuobjdump, so, env)
        native_fp8_run = pool.submit(native_fp8_checks, cuobjdump, so, env)
        max_threads = parse_max_threads(elf_run.result())
        sass = parse_sass(sass_run.result())
        blackwell, blackwell_problems = blackwell_run.result()
        native_fp8, native_fp8_problems = native_fp8_run.result()
    names = demangle([k.mangled for k in kernels])
    launches = read_launch_log(args.launch_log)
    for k in kernels:
        k.name = short_name(names[k.mangled], k.source)
        k.max_threads = max_threads.get(k.mangled)
        k.launched = launches.get(base_identifier(k.name))

    problems = []
    rows = ["| kernel | source | registers | static smem (B) | local (B) | block (threads) | occupancy | limited by |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for k in sorted(kernels, key=lambda k: (k.source, k.name)):
        occ = k.occupancy()
        block = k.block
        local = k.local + k.stack
        if local and k.name not in ACCEPTED_LOCAL:
            problems.append(f"{k.name}: {local} bytes of local memory (register spills or a local array)")
        rows.append(f"| `{k.name}` | {Path(k.source).name} | {k.regs} | {k.shared} | {local} | "
                    f"{block[0] if block else '?'} | {f'{occ[0]:.0%}' if occ else '?'} | {occ[1] if occ else ''} |")
    sass_rows = SASS_CHECKS + (FP8_LOWERED_CHECKS if args.arch in FP8_LOWERED_ARCHS else ())
    checks = ["", "| SASS check | kernels | result |", "|---|---|---|", *sass_checks(sass_rows, kernels, sass, problems)]
    problems += blackwell_problems + native_fp8_problems
    report = "\n".join([f"# Kernel resources: {so.name}", "", *rows, *checks, *blackwell, *native_fp8, ""])
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    if problems:
        print("kernel_resources: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"kernel_resources: {len(kernels)} kernels, no local memory outside the accepted list, "
          f"{len(sass_rows)} SASS checks passed (+ the sm_100f and FP8 native ones)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
