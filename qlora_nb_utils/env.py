"""Facts about the machine a notebook runs on, checked rather than assumed.

QLoRA under ``torch.compile`` fails in ways that depend on the machine more than on the code:
bfloat16 needs an Ampere (SM80) or newer GPU, bitsandbytes may be installed but have no
backend for the device at hand, and the versions of five libraries decide which graph breaks
appear. A notebook that learns these facts halfway through a training run wastes the user's
time, so this module answers them up front, with errors that say what to change.

The bitsandbytes check does real work: it quantizes and dequantizes a small tensor to NF4 on
the device and multiplies by it, because "importable" and "runs on this device" are different
questions. The answer is cached per device type.
"""

import contextlib
import importlib
import importlib.metadata
import logging
import os
import platform
import re
import sys
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch

DeviceLike = Union[str, torch.device, None]

#: Distributions reported by :func:`versions`, in display order.
_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "trl")

#: Accepted spellings of each training dtype.
_DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}

_DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:<index>'"

#: bnb_status results, keyed by device type ("cpu", "cuda").
_BNB_CACHE: Dict[str, Tuple[bool, str]] = {}


def versions() -> Dict[str, Optional[str]]:
    """Versions of Python and of the libraries whose behaviour the notebooks depend on.

    Never raises: a missing library is reported as ``"not installed"``.

    Returns:
        A dict with keys ``python``, ``torch``, ``transformers``, ``peft``, ``bitsandbytes``,
        ``accelerate``, ``datasets``, ``trl`` (version strings) and ``cuda`` (the CUDA version
        torch was built with, or ``None`` for a CPU build).
    """
    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist in _PACKAGES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    return out


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """Turn a user's device choice into a concrete ``torch.device``.

    Args:
        device: ``"auto"`` or ``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:<index>"``, or a ``torch.device`` of type cpu or cuda.

    Returns:
        The device; CUDA devices always carry an index.

    Raises:
        ValueError: for an unknown device string, or a CUDA device that this machine lacks.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device.strip().lower()):
            raise ValueError(f"device must be one of {_DEVICE_CHOICES}; got {device!r}")
        device = torch.device(device.strip().lower())
    if not isinstance(device, torch.device) or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {_DEVICE_CHOICES}; got {device!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} was requested but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
            "Use device='cpu', or 'auto' to pick whatever is available."
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device 'cuda:{index}' does not exist: this machine has "
            f"{torch.cuda.device_count()} CUDA GPU(s)"
        )
    return torch.device("cuda", index)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cpu_mem_gib() -> Optional[float]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def device_info(device: DeviceLike = "auto") -> dict:
    """Describe a device in the terms that matter for QLoRA training.

    Args:
        device: anything :func:`resolve_device` accepts.

    Returns:
        A dict with ``type`` ("cpu"/"cuda"), ``name`` (GPU name or CPU model), ``capability``
        (a ``(major, minor)`` tuple for CUDA, else ``None``), ``total_mem_gib`` (GPU memory, or
        host memory for the CPU; ``None`` if unknown), ``bf16_supported`` (bool) and
        ``sm80_plus`` (bool for CUDA, ``None`` for the CPU).

    Raises:
        ValueError: as :func:`resolve_device`.
    """
    dev = resolve_device(device)
    if dev.type == "cpu":
        return {
            "type": "cpu",
            "name": _cpu_name(),
            "capability": None,
            "total_mem_gib": _cpu_mem_gib(),
            "bf16_supported": True,
            "sm80_plus": None,
        }
    capability = tuple(torch.cuda.get_device_capability(dev))
    props = torch.cuda.get_device_properties(dev)
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(dev),
        "capability": capability,
        "total_mem_gib": props.total_memory / 2**30,
        "bf16_supported": capability >= (8, 0),
        "sm80_plus": capability >= (8, 0),
    }


def _parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    valid = sorted(set(_DTYPE_ALIASES) - {"half", "float"})
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return dtype
        raise ValueError(f"dtype must be one of {valid} (or the torch dtypes); got {dtype}")
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.strip().lower().removeprefix("torch.")]
    raise ValueError(f"dtype must be one of {valid} (or the torch dtypes); got {dtype!r}")


def resolve_dtype(dtype: Union[str, torch.dtype], device: DeviceLike = "auto") -> torch.dtype:
    """Turn a dtype choice into a ``torch.dtype`` the device can train in.

    Args:
        dtype: ``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``, ``"fp32"``/``"float32"``,
            or one of ``torch.bfloat16``, ``torch.float16``, ``torch.float32``.
        device: anything :func:`resolve_device` accepts.

    Returns:
        The torch dtype.

    Raises:
        ValueError: for an unknown dtype (the message lists the valid ones), or bfloat16 on a
            CUDA GPU older than SM80 (the message names the GPU and offers float16).
    """
    parsed = _parse_dtype(dtype)
    dev = resolve_device(device)
    if parsed is torch.bfloat16 and dev.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(dev))
        if capability < (8, 0):
            name = torch.cuda.get_device_name(dev)
            raise ValueError(
                f"bfloat16 needs an Ampere (SM80) or newer GPU, but {name} has compute capability "
                f"{capability[0]}.{capability[1]}. Train in float16 instead: dtype='float16' "
                "(on the command line: --dtype float16)."
            )
    return parsed


def _bnb_round_trip(dev: torch.device) -> None:
    """Quantize, dequantize and multiply through NF4 on ``dev``; raise if anything is off."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=gen).to(dev)
    packed, state = bnbF.quantize_4bit(weight, quant_type="nf4", blocksize=64)
    restored = bnbF.dequantize_4bit(packed, state)
    if restored.shape != weight.shape or not torch.isfinite(restored).all():
        raise RuntimeError("NF4 dequantize returned a wrong shape or non-finite values")
    if (restored - weight).abs().max().item() > 1.0:
        raise RuntimeError("NF4 round trip error is far larger than 4-bit rounding allows")
    x = torch.randn(2, 64, generator=gen).to(dev)
    out = bnb.matmul_4bit(x, packed.t(), quant_state=state)
    if not torch.allclose(out, x @ restored.t(), atol=1e-3, rtol=1e-3):
        raise RuntimeError("NF4 matmul disagrees with the dequantized weights")


def bnb_status(device: DeviceLike = "auto") -> Tuple[bool, str]:
    """Whether bitsandbytes can run NF4 on a device, and why not if it cannot.

    The check imports bitsandbytes and runs a tiny quantize/dequantize/matmul round trip on the
    device; the answer is cached per device type for the life of the process.

    Args:
        device: anything :func:`resolve_device` accepts.

    Returns:
        ``(True, "bitsandbytes <version> runs NF4 on <type>")`` or ``(False, reason)``.

    Raises:
        ValueError: as :func:`resolve_device`.
    """
    dev = resolve_device(device)
    if dev.type not in _BNB_CACHE:
        _BNB_CACHE[dev.type] = _check_bnb(dev)
    return _BNB_CACHE[dev.type]


#: The start of the warning bitsandbytes' CPU backend logs once, when bitsandbytes is imported on a CPU
#: with AVX512-BF16 and its optional fused 4-bit kernel (the ``kernels`` package, which fetches it from
#: the Hugging Face Hub) cannot be loaded.
BNB_CPU_KERNEL_NOTE = "Failed to load CPU gemm_4bit_forward"
#: What :func:`bnb_cpu_kernel_note_in_plain_words` makes of that warning (an INFO record).
BNB_CPU_KERNEL_PLAIN = ("bitsandbytes: 4-bit matmuls on this CPU use bitsandbytes' built-in CPU path, slower than "
                        "its optional fused kernel (the `kernels` package, fetched from the Hugging Face Hub, is not "
                        "available); the results are the same and nothing needs fixing")
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


class _BnbCpuKernelNote(logging.Filter):
    """Turns that one warning into :data:`BNB_CPU_KERNEL_PLAIN` at INFO level; other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(BNB_CPU_KERNEL_NOTE):
            record.msg, record.args = BNB_CPU_KERNEL_PLAIN, ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


@contextlib.contextmanager
def bnb_cpu_kernel_note_in_plain_words() -> Iterator[None]:
    """While open, bitsandbytes' warning about its optional CPU kernel is one INFO line in plain words.

    The warning ("Failed to load CPU gemm_4bit_forward ... pip install kernels") reads like a broken
    install, while nothing is wrong: 4-bit matmuls run on bitsandbytes' built-in CPU path. It is
    logged when bitsandbytes is imported, so the import has to happen inside this block; a filter
    on bitsandbytes' logger does the rewording and is removed on exit, leaving logging as it was.
    INFO is below what Python shows by default, so the line is quiet unless the user turns on
    INFO logging, and then it appears once (bitsandbytes is imported once per process). It is a
    scoped filter rather than one installed when this package is imported because the package
    changes nothing in other libraries at import time.
    """
    logger = logging.getLogger(_BNB_CPU_LOGGER)
    note = _BnbCpuKernelNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def import_bitsandbytes(required: bool = True) -> Any:
    """``import bitsandbytes`` inside :func:`bnb_cpu_kernel_note_in_plain_words`.

    Model loads call this before anything else imports bitsandbytes (PEFT imports it whenever it is
    installed): once it has been imported elsewhere, its warning has already been printed.

    Args:
        required: when False, return None instead of raising where bitsandbytes is missing or
            fails to import (the caller does not need it; whoever does reports the error).

    Raises:
        ImportError (or what a broken install raises), only with ``required=True``.
    """
    with bnb_cpu_kernel_note_in_plain_words():
        try:
            return importlib.import_module("bitsandbytes")
        except Exception:
            if required:
                raise
            return None


def _check_bnb(dev: torch.device) -> Tuple[bool, str]:
    try:
        bnb = import_bitsandbytes()
    except ImportError as exc:
        return False, (
            f"bitsandbytes is not installed ({exc}); install it with `pip install bitsandbytes` "
            "or use quant='none'"
        )
    except Exception as exc:  # a broken install raises all sorts of things at import
        return False, f"bitsandbytes is installed but failed to import: {type(exc).__name__}: {exc}"
    version = getattr(bnb, "__version__", "?")
    try:
        _bnb_round_trip(dev)
    except Exception as exc:
        return False, (
            f"bitsandbytes {version} is installed but cannot run NF4 on {dev.type} "
            f"(no working backend for this device): {type(exc).__name__}: {exc}"
        )
    return True, f"bitsandbytes {version} runs NF4 on {dev.type}"


def require_bnb(device: DeviceLike = "auto") -> None:
    """Raise unless bitsandbytes can run NF4 on ``device``.

    Args:
        device: anything :func:`resolve_device` accepts.

    Raises:
        RuntimeError: with the reason from :func:`bnb_status`.
        ValueError: as :func:`resolve_device`.
    """
    ok, reason = bnb_status(device)
    if not ok:
        raise RuntimeError(f"4-bit (NF4) loading is not possible here: {reason}")


def default_dtype(device: torch.device) -> str:
    """bf16 on SM80+ GPUs, fp16 on older ones, fp32 on a CPU (exact parity, no slow bf16 emulation)."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.get_device_capability(device) >= (8, 0) else "float16"
    return "float32"


def resolve_device_dtype(device: Any = "auto", dtype: Any = "auto") -> tuple[torch.device, torch.dtype]:
    """(device, dtype) from names: ``"auto"`` (or None) dtype is :func:`default_dtype` of the device.

    Raises:
        ValueError: an unknown device or dtype name (from ``resolve_device``/``resolve_dtype``).
    """
    dev = resolve_device(device)
    return dev, resolve_dtype(default_dtype(dev) if dtype in (None, "auto") else dtype, dev)


#: The allocator setting a memory target asks for. A long sequence's step frees and allocates
#: blocks of many sizes (each layer's input copied back, loss pieces, attention workspaces); with
#: fixed-size segments the cached free blocks stop fitting the next large request, and a step can
#: run out of memory with gigabytes reserved but unallocated. Expandable segments grow and shrink
#: one mapping instead.
EXPANDABLE_SEGMENTS = "expandable_segments:True"
_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments() -> Tuple[bool, str]:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for this process when nothing has
    chosen an allocator setting yet and CUDA is not yet initialized (the allocator reads it once).

    The command line calls it for a run with a memory target; a Python user sets the variable
    before the first CUDA call instead.

    Returns:
        ``(set, why)``: whether this call set it, and why (or why not).
    """
    for name in _ALLOC_ENV:
        if os.environ.get(name):
            return False, f"{name}={os.environ[name]} is already set: left as it is"
    if torch.cuda.is_initialized():
        return False, "CUDA is already initialized: the allocator has read its settings"
    os.environ[_ALLOC_ENV[0]] = EXPANDABLE_SEGMENTS
    return True, f"{_ALLOC_ENV[0]}={EXPANDABLE_SEGMENTS} (fewer stranded cached blocks under a memory target)"


#: The heavy libraries every run imports: where their bytecode is missing, each start compiles them.
BYTECODE_MODULES = ("torch", "torch._dynamo", "torch._inductor.lowering", "sympy", "transformers", "peft",
                    "bitsandbytes")


def missing_bytecode(modules: Tuple[str, ...] = BYTECODE_MODULES) -> list:
    """The imported ``modules`` whose bytecode file is absent after their import: each new process
    compiles their sources again.

    Why: an install leaves each module's bytecode beside its source (``pip install`` writes it, and
    the first import writes what is missing), so a start only reads it. Where an image sets
    ``PYTHONDONTWRITEBYTECODE`` or installs into a read-only folder without it, every start compiles
    torch's and its neighbours' sources again, seconds each time, before the first line of a run.
    A module not imported (or built in) is not reported.
    """
    out = []
    for name in modules:
        mod = sys.modules.get(name)
        cached = getattr(mod, "__cached__", None) if mod is not None else None
        if cached and str(getattr(mod, "__file__", "")).endswith(".py") and not os.path.exists(cached):
            out.append(name)
    return out


def bytecode_note(modules: Tuple[str, ...] = BYTECODE_MODULES) -> Optional[str]:
    """One line for a run's log where :func:`missing_bytecode` finds any, with the command that writes
    their bytecode once (for the folders they are installed in); None where every imported one has it."""
    missing = missing_bytecode(modules)
    if not missing:
        return None
    pycache = os.path.dirname(sys.modules[missing[0]].__cached__)
    folder = pycache if os.path.isdir(pycache) else os.path.dirname(pycache)
    why = ("PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode
           else "the install's folders are read-only" if not os.access(folder, os.W_OK) else "not written")
    sites = []
    for name in missing:
        top = sys.modules[name.split(".")[0]]
        site = os.path.dirname(top.__file__)
        site = os.path.dirname(site) if hasattr(top, "__path__") else site  # a package: the folder holding it
        if site not in sites:
            sites.append(site)
    return (f"note: no bytecode for {', '.join(missing)} ({why}): every start compiles their sources again; "
            f"write it once with: {sys.executable} -m compileall -q -j 0 {' '.join(sites)}")
