"""Random bad and edge-case calls of every public op (tests/fuzz_inputs.py): each returns, or raises a TypeError
or ValueError naming what was wrong, on the references (CPU tier) and through the kernels (GPU tier: the
CPU-executed kernels in CI, under ASan in its subset, and a GPU where there is one). Where both the kernels and
the references return, the outputs have the same shapes and dtypes. scripts/fuzz_ops.py runs many more seeds,
each batch in a fresh process, so a crash names its seed."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_kernels._ext import reference_ops
from tests.fuzz_inputs import explain, make_case, run_case

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(0, 400)
CHUNK = 50


def _check(seeds, device, compare: bool) -> None:
    bad = []
    for seed in seeds:
        case = make_case(seed, device)
        got = run_case(case)
        if not got.acceptable():
            bad.append(explain(case, got))
            continue
        if compare and got.ok:
            with reference_ops():
                ref = run_case(make_case(seed, device))
            if ref.ok:
                shapes = [(tuple(o.shape), o.dtype) for o in got.outputs]
                want = [(tuple(o.shape), o.dtype) for o in ref.outputs]
                if shapes != want:
                    bad.append(f"{case.describe()}: outputs {shapes}, the reference's {want}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("start", range(SEEDS.start, SEEDS.stop, CHUNK))
def test_bad_inputs_on_the_references(start):
    _check(range(start, start + CHUNK), "cpu", compare=False)


@pytest.mark.gpu
@pytest.mark.parametrize("start", range(SEEDS.start, SEEDS.stop, CHUNK))
def test_bad_inputs_on_the_kernels(cuda, start):
    if cuda.type == "cuda":  # in a process of its own: a device-side fault would end this one's CUDA context
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_ops.py"), "--seeds", f"{start}:{start + CHUNK}",
                            "--device", "cuda"], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        return
    _check(range(start, start + CHUNK), cuda, compare=True)
