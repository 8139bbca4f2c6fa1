"""Hardware classes: where reference numbers come from (`cpu`, `cuda-sm90`, ...)."""

from __future__ import annotations

import os
import re
import warnings

import torch

from ..errors import VeosnapError

# cuBLAS reads this once, when CUDA starts: deterministic GEMMs need it set before any CUDA call.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

ENV_VAR = "VEOSNAP_HARDWARE_CLASS"
_CLASS_RE = re.compile(r"^(cpu|cuda-sm\d{2,3})$")


def detect() -> str:
    """The hardware class of this machine: `cuda-sm<major><minor>` if a GPU is visible, else `cpu`; an error
    where a GPU is there but CUDA failed to start (out of memory, a driver mismatch), which must not pass for a
    cpu machine: its checks would run the CPU's code and pass, proving nothing about the GPU's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if available:
        major, minor = torch.cuda.get_device_capability()
        return f"cuda-sm{major}{minor}"
    failed = [str(w.message) for w in caught if "CUDA initialization" in str(w.message)
              and "no NVIDIA driver" not in str(w.message)]
    if failed:
        cause = failed[0].split("(Triggered internally")[0].strip().removeprefix("CUDA initialization: ")
        raise VeosnapError(f"this machine has a GPU but CUDA failed to start ({cause}); veosnap will not take it "
                           "for a cpu machine: fix CUDA, or hide the GPU (CUDA_VISIBLE_DEVICES=) to run on the CPU on purpose")
    return "cpu"


def resolve(flag: str | None = None) -> str:
    """The class to use: the flag, else $VEOSNAP_HARDWARE_CLASS, else the detected one."""
    value = flag or os.environ.get(ENV_VAR) or detect()
    if not _CLASS_RE.match(value):
        source = "--hardware-class" if flag else ENV_VAR if os.environ.get(ENV_VAR) else "detection"
        raise VeosnapError(f"{source}: unknown hardware class {value!r} (expected 'cpu' or 'cuda-sm<NN>', e.g. cuda-sm90)")
    return value


def device_for(hardware_class: str) -> torch.device:
    """The torch device a hardware class runs on."""
    return torch.device("cpu") if hardware_class == "cpu" else torch.device("cuda")


def describe_device(device: torch.device) -> dict[str, str]:
    """Provenance of the device: its name, capability, driver and CUDA version where there are any."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info = {
            "device": props.name,
            "capability": f"{props.major}.{props.minor}",
            "cuda": str(torch.version.cuda),
        }
        try:  # the driver version is only reachable through NVML
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - provenance is best effort
            info["driver"] = "unknown"
        return info
    return {"device": _cpu_model_name(), "capability": "cpu"}


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"
