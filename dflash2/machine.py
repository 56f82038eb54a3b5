"""What this machine can do, probed once. Every default that depends on the hardware reads it here.

Many CPUs (AMD Zen 2/3, Intel client parts since the 12th generation, older ARM servers) have AVX2 but
no native bf16: oneDNN's bf16 kernels raise there, and aten runs bf16 by converting every element. So
a bf16 checkpoint runs in float32 on such a CPU, and bf16 weights are packed only where oneDNN has
bf16 kernels.

Tests, and users who want to see another machine's defaults, override the probe: `override(native_bf16=False)`
in code, or the environment variable DFLASH2_MACHINE="native_bf16=0,onednn=1,cpu_capability=AVX2".
"""
import contextlib
import dataclasses
import functools
import os

import torch


@dataclasses.dataclass(frozen=True)
class Machine:
    cpu_capability: str  # torch's CPU kernel level: DEFAULT, AVX2, AVX512, ZVECTOR, SVE256, ...
    native_bf16: bool  # oneDNN has bf16 kernels here (AVX512 BW/VL/DQ, AVX-NE-CONVERT, or ARM bf16)
    onednn: bool  # this torch has oneDNN's packed linear (kernels.PackedLinear)
    cuda_capability: tuple | None  # (major, minor) of CUDA device 0, None without CUDA
    mps: bool

    def packs(self, dtype):
        """Whether a CPU linear of this dtype runs through oneDNN with its weight packed once."""
        return self.onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and self.native_bf16))

    def describe(self):
        """One line for stats lines and reports, e.g. "CPU AVX2, no native bf16, oneDNN"."""
        parts = [f"CPU {self.cpu_capability}", "native bf16" if self.native_bf16 else "no native bf16",
                 "oneDNN" if self.onednn else "no oneDNN"]
        if self.cuda_capability:
            parts.append("CUDA sm%d%d" % tuple(self.cuda_capability))
        if self.mps:
            parts.append("MPS")
        return ", ".join(parts)

    def asdict(self):
        return dataclasses.asdict(self)


def probe():
    """The machine as torch sees it (no override)."""
    mkldnn = torch.ops.mkldnn
    onednn = torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
    native_bf16 = False
    if onednn:
        try:
            native_bf16 = bool(mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native_bf16 = False
    cuda = tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Machine(torch.backends.cpu.get_cpu_capability(), native_bf16, onednn, cuda, mps)


def _from_env(m):
    spec = os.environ.get("DFLASH2_MACHINE", "").strip()
    if not spec:
        return m
    fields = {f.name: f for f in dataclasses.fields(Machine)}
    changes = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if name not in fields or name == "cuda_capability":
            raise ValueError(f"DFLASH2_MACHINE: unknown field {name!r}; fields: cpu_capability, native_bf16, onednn, mps")
        changes[name] = value if name == "cpu_capability" else value.lower() in ("1", "true", "yes")
    return dataclasses.replace(m, **changes)


_probed = functools.cache(lambda: _from_env(probe()))
_override = []


def machine():
    """This machine (the innermost override, if any)."""
    return _override[-1] if _override else _probed()


@contextlib.contextmanager
def override(**fields):
    """Run a block as if the machine had these fields, e.g. override(native_bf16=False, cpu_capability="AVX2")."""
    _override.append(dataclasses.replace(machine(), **fields))
    try:
        yield _override[-1]
    finally:
        _override.pop()


def emulated(device, dtype):
    """Whether this dtype runs element by element converted on this device (bf16 or fp16 on such a CPU)."""
    return torch.device(device).type == "cpu" and (dtype == torch.float16 or (dtype == torch.bfloat16
                                                                               and not machine().native_bf16))


def draft_dtype(device, checkpoint_dtype, requested=None):
    """(dtype, reason) the drafter runs in: the one asked for, else its checkpoint's, except that a
    half-precision checkpoint runs in float32 on a CPU without native bf16 (and fp16 on every CPU)."""
    device = torch.device(device)
    name = str(checkpoint_dtype).removeprefix("torch.")
    if requested is not None:
        slow = f"; this CPU has no native {str(requested).removeprefix('torch.')}, so it runs unpacked and slowly"
        return requested, "asked for" + (slow if emulated(device, requested) else "")
    if emulated(device, checkpoint_dtype):
        return torch.float32, f"the checkpoint's {name} runs emulated on this CPU ({machine().cpu_capability}, no native {name})"
    return checkpoint_dtype, "the checkpoint's"


def half_dtype(device):
    """The fast low-precision dtype for a target or for autocast on this device: bfloat16 on CUDA and on
    CPUs with native bf16, else float32 (emulated bf16 is slower than float32)."""
    device = torch.device(device)
    if device.type == "cpu" and not machine().native_bf16:
        return torch.float32
    return torch.bfloat16
