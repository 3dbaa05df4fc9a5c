"""Barrier check of the emulated GPU tier: delete each `__syncthreads()` and `__syncwarp()` of the
hand-written kernels, one at a time, and show that a test fails without it.

    python scripts/barrier_check.py [--only TEXT ...] [--schedules forward,reverse,random:1]
                                    [--map FILE] [--jobs N] [--max-tests N] [--markdown FILE]

A deleted barrier is a race, and on the CPU-executed kernels (tools/cuda_on_cpu) a race shows only when
the order in which threads and blocks run exposes it: the default order runs a block's threads in index
order, so a read of a lower thread's unsynchronised write still sees the value. Each site is therefore
tried under several schedules (`MOE_KERNELS_EMU_SCHEDULE`), the first that fails the site's tests
named in the report. Nothing is rebuilt: `MOE_KERNELS_EMU_SKIP_SYNC=FILE:LINE` makes the runtime pass
over that one barrier, as if deleted.

Which tests reach which site comes from one run of the GPU tier with `MOE_KERNELS_EMU_SYNC_LOG` (or
`--map`, a log written before); each site then runs only those tests (at most `--max-tests`, spread
over them; a site that survives them runs all of its tests). A site that survives every schedule is either not needed, or not covered by a test that
would fail without it: the report lists both kinds for a reader to settle. Outside CI (several minutes
on two cores); needs `moe_kernels._C_emu` (pip install -e .).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# CUTLASS instances: never compiled for the CPU.
EXCLUDED = ("gemm/sm90/", "gemm/sm100/")
BARRIER = re.compile(r"\b(__syncthreads\(\)|__syncwarp\([^;]*\))\s*;")


@dataclasses.dataclass
class Site:
    file: str  # relative to csrc/
    line: int
    code: str
    tests: list[str] = dataclasses.field(default_factory=list)
    all_tests: list[str] = dataclasses.field(default_factory=list)
    killed_by: str | None = None
    error: str | None = None
    runs: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}"


def find_sites(only: list[str]) -> list[Site]:
    sites = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cu", ".cuh", ".h"):
            continue
        rel = path.relative_to(CSRC).as_posix()
        if rel.startswith(EXCLUDED):
            continue
        for i, text in enumerate(path.read_text().splitlines(), 1):
            code = text.split("//", 1)[0]
            if BARRIER.search(code):
                site = Site(rel, i, text.strip())
                if not only or any(o in site.key or o in site.code for o in only):
                    sites.append(site)
    return sites


def emu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MOE_KERNELS_EMULATE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MOE_KERNELS_EMU_SKIP_SYNC", None)
    env.pop("MOE_KERNELS_EMU_SYNC_LOG", None)
    env.update(extra)
    return env


def write_map(path: Path, jobs: int) -> None:
    """One run of the GPU tier on the CPU-executed kernels, logging which test reaches which barrier."""
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    if jobs > 1:
        cmd[4:4] = ["-n", str(jobs)]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=emu_env(MOE_KERNELS_EMU_SYNC_LOG=str(path)), capture_output=True, text=True)
    tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    print(f"map: the GPU tier in {time.time() - t0:.0f} s: {tail[0] if tail else '(no output)'}", flush=True)
    if r.returncode != 0:
        sys.exit("the GPU tier fails without any barrier removed; fix that first:\n" + r.stdout[-4000:] + r.stderr[-2000:])


def read_map(path: Path, sites: list[Site], max_tests: int) -> None:
    reached: dict[str, set[str]] = {}
    for row in path.read_text().splitlines():
        where, _, test = row.partition("\t")
        file, _, line = where.rpartition(":")
        file = Path(file).as_posix()
        if "/csrc/" not in file:
            continue
        rel = file.rsplit("/csrc/", 1)[1]
        reached.setdefault(f"{rel}:{line}", set()).add(test)
    for site in sites:
        tests = sorted(reached.get(site.key, ()))
        site.all_tests = tests
        if len(tests) > max_tests:  # spread over the list (it is sorted by file and name)
            step = len(tests) / max_tests
            tests = [tests[int(i * step)] for i in range(max_tests)]
        site.tests = tests


def try_site(site: Site, schedules: list[str], timeout: int, retry: bool) -> Site:
    t0 = time.time()
    try_tests(site, site.tests, schedules, timeout)
    if not site.killed_by and not site.error and len(site.all_tests) > len(site.tests) and retry:
        rest = [t for t in site.all_tests if t not in set(site.tests)]  # a survivor of the sample: its other tests
        site.tests = site.all_tests
        try_tests(site, rest, schedules, timeout)
    site.seconds = time.time() - t0
    return site


def try_tests(site: Site, tests: list[str], schedules: list[str], timeout: int) -> None:
    for schedule in schedules:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *tests]
        with tempfile.NamedTemporaryFile(suffix=".log") as log:
            env = emu_env(MOE_KERNELS_EMU_SCHEDULE=schedule, MOE_KERNELS_EMU_SKIP_SYNC=f"csrc/{site.key}",
                          MOE_KERNELS_EMU_SYNC_LOG=log.name)
            try:
                r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
                rc = r.returncode
            except subprocess.TimeoutExpired:
                site.error = f"timeout after {timeout} s under {schedule}"  # slowness, not a verdict
                break
            # The runtime logs the sites it reaches, the skipped one too: a site never reached was not deleted
            # (a stale build whose lines moved, or a test that no longer reaches it).
            reached = any(row.split("\t", 1)[0].endswith(f"/csrc/{site.key}") for row in Path(log.name).read_text().splitlines())
        site.runs.append(f"{schedule}: {rc}")
        if rc == 0 and not reached:
            site.error = f"the tests passed under {schedule} without reaching the barrier (stale build?)"
            break
        if rc == 0:
            continue
        if rc in (2, 3, 4, 5):  # interrupted, internal or usage error, nothing collected: not the kernel's doing
            site.error = f"pytest exit {rc} under {schedule}: {(r.stdout + r.stderr).strip()[-300:]}"
        else:  # 1: a test failed; negative: the process crashed
            site.killed_by = schedule if rc == 1 else f"{schedule} ({rc})"
        break


def check_schedules(schedules: list[str]) -> None:
    """Each schedule loads (a bad one aborts the runtime at load, which would read as a crash of every site)."""
    for schedule in schedules:
        r = subprocess.run([sys.executable, "-c", "import moe_kernels._C_emu"], cwd=ROOT, capture_output=True,
                           text=True, env=emu_env(MOE_KERNELS_EMU_SCHEDULE=schedule))
        if r.returncode != 0:
            sys.exit(f"schedule {schedule!r} does not load: {(r.stdout + r.stderr).strip()[-500:]}")


def report(sites: list[Site], schedules: list[str]) -> str:
    killed = [s for s in sites if s.killed_by]
    unreached = [s for s in sites if not s.tests]
    survived = [s for s in sites if s.tests and not s.killed_by and not s.error]
    errors = [s for s in sites if s.error]
    by = {sched: sum(1 for s in killed if s.killed_by.split(" ")[0] == sched) for sched in schedules}
    lines = [
        f"{len(sites)} barrier sites: {len(killed)} fail a test when deleted "
        + ", ".join(f"{n} first under {sched}" for sched, n in by.items())
        + f"; {len(survived)} survive every schedule; {len(unreached)} reached by no GPU-tier test"
        + (f"; {len(errors)} could not be tried (an error or a timeout)." if errors else "."),
        "",
        "| site | barrier | tests run | fails under |",
        "|---|---|---|---|",
    ]
    for s in sites:
        error = " ".join(s.error.split()).replace("|", "/") if s.error else None  # one table cell
        verdict = s.killed_by or error or ("not reached" if not s.tests else "**survives**")
        lines.append(f"| `{s.key}` | `{s.code[:60]}` | {len(s.tests)} | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[], help="sites whose FILE:LINE or code contains one of these")
    ap.add_argument("--schedules", default="forward,reverse,random:1,random:2")
    ap.add_argument("--map", type=Path, help="a barrier log written before (MOE_KERNELS_EMU_SYNC_LOG); made if absent")
    ap.add_argument("--jobs", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--max-tests", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--no-retry", action="store_true", help="survivors of the sample are not run on every test")
    ap.add_argument("--markdown", type=Path, help="also write the report here")
    args = ap.parse_args()
    schedules = [s for s in args.schedules.split(",") if s]
    if args.max_tests < 1:
        sys.exit("--max-tests must be at least 1")
    check_schedules(schedules)

    sites = find_sites(args.only)
    if not sites:
        sys.exit("no barrier sites match")
    map_path = args.map or Path(tempfile.gettempdir()) / "moe_kernels_barrier_map.log"
    if args.map is None or not args.map.exists():
        write_map(map_path, args.jobs)
    read_map(map_path, sites, args.max_tests)
    print(f"{len(sites)} sites, schedules {', '.join(schedules)}, {args.jobs} at a time", flush=True)

    todo = [s for s in sites if s.tests]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for site in pool.map(lambda s: try_site(s, schedules, args.timeout, not args.no_retry), todo):
            print(f"  {site.key:40s} {site.killed_by or ('ERROR' if site.error else 'SURVIVES'):22s} {len(site.tests):3d} tests "
                  f"{site.seconds:5.0f} s", flush=True)
    text = report(sites, schedules)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
