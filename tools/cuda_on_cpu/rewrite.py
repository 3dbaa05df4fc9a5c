"""Copy CUDA sources for the host compiler, rewriting the three constructs it cannot read.

    kernel<T><<<grid, block, smem, stream>>>(args)
        -> ::emu::launch("kernel<T>", __FILE__, __LINE__, ::emu::kernel_address(kernel<T>), grid, block, smem,
                         stream)(
               [&](auto... emu_a) { kernel<T>(emu_a...); }, args)
    extern __shared__ __align__(16) float smem[];
        -> float* const smem = reinterpret_cast<float*>(::emu::dynamic_shared());
    __shared__ float a[8], b;
        -> static float a[8], b; (each filled with 0xff by the first thread of every block to pass here)

Every copy starts with `#line 1 "<original path>"` and keeps its line breaks, so compiler messages,
__FILE__/__LINE__ and sanitizer reports point at the original source. The sources themselves are never
edited.

    python rewrite.py SRC_ROOT OUT_ROOT [--exclude DIR]...
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inl")


class RewriteError(ValueError):
    pass


def mask_comments_and_strings(src: str) -> str:
    """`src` with comments and string/char literals blanked (same length, newlines kept)."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = [ch if ch == "\n" else " " for ch in src[i:j]]
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out[i + 1 : j - 1] = " " * max(0, j - 1 - (i + 1))
            i = j
        else:
            i += 1
    return "".join(out)


def _kernel_start(masked: str, end: int) -> int:
    """Start of the kernel expression that ends just before `end` (`name`, `ns::name<T, 4>`, ...)."""
    i = end
    while i > 0 and masked[i - 1] in " \t":
        i -= 1
    depth = 0
    while i > 0:
        c = masked[i - 1]
        if c == ">":
            depth += 1
        elif c == "<":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and not (c.isalnum() or c in "_:"):
            break
        elif depth > 0 and c == "\n":
            raise RewriteError("a kernel's template arguments span lines")
        i -= 1
    return i


def _matching_close(masked: str, start: int, open_: str, close: str) -> int:
    depth = 0
    for j in range(start, len(masked)):
        if masked[j] == open_:
            depth += 1
        elif masked[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise RewriteError(f"no matching {close!r}")


def _rewrite_launches(src: str, masked: str) -> tuple[str, str]:
    pieces, mpieces, pos = [], [], 0
    for m in re.finditer(r"<<<", masked):
        if m.start() < pos:
            continue
        k0 = _kernel_start(masked, m.start())
        kernel = src[k0 : m.start()].strip()
        if not kernel:
            raise RewriteError(f"no kernel name before <<< at offset {m.start()}")
        cfg_end = masked.find(">>>", m.end())
        if cfg_end < 0:
            raise RewriteError("<<< without >>>")
        cfg = src[m.end() : cfg_end]
        j = cfg_end + 3
        while j < len(masked) and masked[j] in " \t\n":
            j += 1
        if j >= len(masked) or masked[j] != "(":
            raise RewriteError(f"launch of {kernel} without an argument list")
        close = _matching_close(masked, j, "(", ")")
        empty = masked[j + 1 : close].strip() == ""
        lam = f"[&](auto... emu_a) {{ {kernel}(emu_a...); }}"
        head = f'::emu::launch("{kernel}", __FILE__, __LINE__, ::emu::kernel_address({kernel}), {cfg})({lam}'
        head += "" if empty else ", "
        # Keep the line breaks of the replaced span (between the kernel name and the "(" of the arguments).
        head += "\n" * (src[k0 : j + 1].count("\n") - cfg.count("\n"))
        pieces += [src[pos:k0], head]
        mpieces += [masked[pos:k0], " " * len(head)]
        pos = j + 1
    pieces.append(src[pos:])
    mpieces.append(masked[pos:])
    return "".join(pieces), "".join(mpieces)


_ALIGN = re.compile(r"__align__\s*\(\s*\d+\s*\)|alignas\s*\(\s*\d+\s*\)")
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([^;\[\]]*?)\b(\w+)\s*\[\s*\]\s*;")
_SHARED = re.compile(r"\b__shared__\b([^;]*);")


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def _rewrite_shared(src: str, masked: str) -> str:
    pieces, pos = [], 0
    for m in _EXTERN_SHARED.finditer(masked):
        ty = _ALIGN.sub("", src[m.start(1) : m.end(1)]).strip()
        name = m.group(2)
        if not ty:
            raise RewriteError(f"extern __shared__ {name}[] without a type")
        pieces += [src[pos : m.start()], f"{ty}* const {name} = reinterpret_cast<{ty}*>(::emu::dynamic_shared());"]
        pos = m.end()
    pieces.append(src[pos:])
    src = "".join(pieces)
    masked = _EXTERN_SHARED.sub(lambda m: " " * (m.end() - m.start()), masked)
    # Rewrites above keep offsets only up to the first change: recompute the mask.
    masked = mask_comments_and_strings(src)

    pieces, pos = [], 0
    for m in _SHARED.finditer(masked):
        body = src[m.start(1) : m.end(1)]
        if "\n" in body:
            raise RewriteError("a __shared__ declaration spans lines")
        # "T a[8], b" -> the type is everything before the first declarator's name.
        decls = _split_top_level(body)
        first = re.match(r"(.*?)(\b\w+)\s*((?:\[[^\]]*\]\s*)*)$", decls[0].strip())
        if not first:
            raise RewriteError(f"cannot read the __shared__ declaration {body.strip()!r}")
        names = [first.group(2)]
        for d in decls[1:]:
            dm = re.match(r"\s*(\w+)\s*((?:\[[^\]]*\]\s*)*)$", d)
            if not dm:
                raise RewriteError(f"cannot read the __shared__ declarator {d.strip()!r}")
            names.append(dm.group(1))
        poison = " ".join(
            f"static uint64_t emu_epoch_{n} = 0; ::emu::shared_declared(&{n}, sizeof({n}), &emu_epoch_{n});"
            for n in names
        )
        pieces += [src[pos : m.start()], f"static{body}; {poison}"]
        pos = m.end()
    pieces.append(src[pos:])
    return "".join(pieces)


def rewrite_source(src: str, origin: str) -> str:
    masked = mask_comments_and_strings(src)
    src, masked = _rewrite_launches(src, masked)
    src = _rewrite_shared(src, mask_comments_and_strings(src))
    return f'#line 1 "{origin}"\n{src}'


def rewrite_tree(src_root: Path, out_root: Path, exclude: list[str]) -> list[Path]:
    written = []
    for path in sorted(src_root.rglob("*")):
        rel = path.relative_to(src_root)
        if not path.is_file() or path.suffix not in SUFFIXES:
            continue
        if any(rel.as_posix() == e or rel.as_posix().startswith(e.rstrip("/") + "/") for e in exclude):
            continue
        try:
            text = rewrite_source(path.read_text(), str(path.resolve()))
        except RewriteError as exc:
            raise SystemExit(f"{path}: {exc}") from exc
        dest = out_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists() or dest.read_text() != text:  # unchanged copies keep their timestamps
            dest.write_text(text)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src_root", type=Path)
    ap.add_argument("out_root", type=Path)
    ap.add_argument("--exclude", action="append", default=[], help="a folder (relative to SRC_ROOT) to skip")
    args = ap.parse_args(argv)
    files = rewrite_tree(args.src_root, args.out_root, args.exclude)
    print(f"cuda_on_cpu: rewrote {len(files)} files into {args.out_root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
