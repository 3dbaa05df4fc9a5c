"""Step metrics: one log line per N steps, a JSONL file, optional TensorBoard."""

from __future__ import annotations

import json
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
    )


class MetricsLogger:
    def __init__(self, out_dir: Path, *, tensorboard: bool = False, echo=print):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._echo = echo
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is optional
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
            self._tb = SummaryWriter(str(out_dir / "tensorboard"))

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
