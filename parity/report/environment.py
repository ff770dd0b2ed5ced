"""Where a benchmark ran: versions, hardware and thread settings (the RFC's list)."""

from __future__ import annotations

import os
import platform

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: str) -> dict[str, str]:
    import torch.distributed as dist

    env = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu": _cpu_model(), "cpu cores": str(os.cpu_count()),
        "threads (torch.get_num_threads in the parent)": str(torch.get_num_threads()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "worker threads": "1 (torch.set_num_threads(1) per rank)",
        "gloo": "available" if dist.is_gloo_available() else "no",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a",
        "cuda": torch.version.cuda or "n/a", "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = str(torch.cuda.device_count())
    return env
