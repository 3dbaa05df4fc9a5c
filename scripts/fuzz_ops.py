"""Random bad and edge-case calls of every public op (tests/fuzz_inputs.py), many more seeds than the test
tier runs, each batch in a fresh process so that a crash (a segfault, an ASan report, the OOM killer) names
its seed and the run goes on after it.

    python scripts/fuzz_ops.py --seeds 0:5000                      # the references (CPU)
    MOE_KERNELS_EMULATE=1 python scripts/fuzz_ops.py --seeds 0:5000  # the CPU-executed kernels
    python scripts/fuzz_ops.py --seeds 0:5000 --asan               # the same under ASan + UBSan
    python scripts/fuzz_ops.py --seeds 0:5000 --device cuda        # the kernels on a GPU

Prints each case that crashed or raised an error that does not name the argument (Outcome.acceptable),
with its seed and changes; exits 1 if there was any. One case alone: --seeds 1234:1235 --verbose.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(start: int, stop: int, device: str, verbose: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fuzz_inputs import explain, make_case, run_case

    for seed in range(start, stop):
        print(json.dumps({"start": seed}), flush=True)
        case = make_case(seed, device)
        got = run_case(case)
        rec = {"seed": seed, "op": case.op, "ok": got.ok, "acceptable": got.acceptable()}
        if not got.ok:
            rec["error"] = explain(case, got)
        if verbose:
            print(case.describe(), "->", "ok" if got.ok else rec["error"], file=sys.stderr)
        print(json.dumps(rec), flush=True)


def _asan_env() -> dict:
    def lib(name):
        return subprocess.check_output(["gcc", f"-print-file-name={name}"], text=True).strip()

    return dict(LD_PRELOAD=f"{lib('libasan.so')} {lib('libstdc++.so')}", ASAN_OPTIONS="detect_leaks=0",
                MOE_KERNELS_EMULATE="asan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:2000", help="START:STOP")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--asan", action="store_true", help="the CPU-executed kernels under ASan + UBSan")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    start, stop = (int(v) for v in a.seeds.split(":"))
    if a.worker:
        _worker(start, stop, a.device, a.verbose)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if a.asan:
        env.update(_asan_env())
    seed, bad, counts = start, [], {"ok": 0, "error": 0}
    while seed < stop:
        cmd = [sys.executable, __file__, "--worker", "--seeds", f"{seed}:{stop}", "--device", a.device]
        p = subprocess.run(cmd + (["--verbose"] if a.verbose else []), env=env, capture_output=True, text=True)
        last = None
        for line in p.stdout.splitlines():
            rec = json.loads(line)
            if "start" in rec:
                last = rec["start"]
                continue
            counts["ok" if rec["ok"] else "error"] += 1
            if not rec["acceptable"]:
                bad.append(rec["error"])
        if a.verbose:
            sys.stderr.write(p.stderr)
        if p.returncode == 0:
            break
        bad.append(f"seed {last}: the process died (exit {p.returncode}): {p.stderr.strip()[-1500:]}")
        seed = (last if last is not None else seed) + 1
    print(f"{stop - start} cases: {counts['ok']} returned, {counts['error']} raised; {len(bad)} not acceptable")
    for b in bad:
        print(" ", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
