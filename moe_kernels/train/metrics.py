"""Step metrics: one log line per N steps, a JSONL file, optional TensorBoard."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks from the datasheets (no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_line(m: dict) -> str:
    mfu = f"{m['mfu'] * 100:5.2f}%" if m.get("mfu") is not None else "  -  "
    return (
        f"step {m['step']:>6}  loss {m['loss']:7.4f}  aux {m['aux_loss']:.4f}  grad_norm {m['grad_norm']:7.3f}  "
        f"lr {m['lr']:.2e}  tok/s {m['tokens_per_s']:>9,.0f}  TFLOP/s {m['tflops']:7.2f}  MFU {mfu}  "
        f"mem {m['memory_gib']:.2f}GiB"
        + (f"  tok/step {m['tokens_per_step']:,}" if m.get("tokens_per_step") is not None else "")
        + (f"  optim {m['optimizer_share'] * 100:4.1f}%" if m.get("optimizer_share") is not None else "")
        + (f"  dropped {m['dropped_tokens']:,}" if m.get("dropped_tokens") is not None else "")
    )


METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"


def _truncate_after(path: Path, step: int) -> None:
    """Drops the records of steps after `step` (and a torn last line) from a metrics file, atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def clear(out_dir: Path) -> None:
    """Removes a run's metrics file and TensorBoard event files from `out_dir`."""
    (out_dir / METRICS).unlink(missing_ok=True)
    for path in (out_dir / TENSORBOARD).glob("events.out.tfevents.*"):
        path.unlink()


class MetricsLogger:
    """Writes `metrics.jsonl` (and TensorBoard events) under `out_dir`. `resume_step=None` starts a new
    metrics file; a step continues the existing one after dropping what was logged past that step (by a
    run that went on beyond its last checkpoint), so a resumed run does not log a step twice."""

    def __init__(self, out_dir: Path, *, tensorboard: bool = False, echo=print, resume_step: int | None = None):
        writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter as writer
            except ImportError as exc:  # tensorboard is optional
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / METRICS
        if resume_step is not None:
            _truncate_after(self.path, resume_step)
        self._file = open(self.path, "w" if resume_step is None else "a", encoding="utf-8")
        self._echo = echo
        self._tb = None
        if writer is not None:
            # TensorBoard hides the records of earlier event files from purge_step on.
            purge_step = 0 if resume_step is None else resume_step + 1
            self._tb = writer(str(out_dir / TENSORBOARD), purge_step=purge_step)

    def log(self, record: dict, *, line: str | None = None) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if line is not None:
            self._echo(line)
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
