"""The packed few-row matmul (packed_rows.cpp), and DeLS's fused tree node (fused_node.cpp): built
for this machine on first use, then loaded.

Why a kernel of our own: a decoding step multiplies 1 to 16 rows by every weight of the target,
and on a CPU neither of PyTorch's routes streams the weights at memory speed for more than one
or two rows (the general GEMM repacks the weight on every call; the weight-left product stays
well under the core's peak). With the weights packed once into panels read in order, a product
of up to 12 rows costs about what one row costs (SmolLM2-135M's products, one thread:
docs/dflash.md), which makes verifying a draft almost free next to the plain step.

The source is compiled with the host's compiler for the host's CPU (`-march=native`) into the
cache (`kernels/`), keyed by the source, the flags, the torch build and the CPU, with OpenMP so that
`at::parallel_for` splits the panels over torch's threads (without it the header runs them on one
thread: 11.0 against 5.5 ms for 453 MB of weights on two threads here), and loaded as the torch op
`torch.ops.specflash_rows.packed_linear`. Where there is no compiler, or it fails, `load` says why
once and returns False, and the row plan keeps PyTorch's kernels.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

PANEL = 32  # output rows per panel: packed_rows.cpp's PANEL
# one library: the packed product, and DeLS's fused tree node (fused_node.cpp), which drafting
# takes where the library loaded (models/local_head.py TokenStep.fused)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("packed_rows.cpp", "fused_node.cpp"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=gnu++17", "-shared", "-fPIC")

_state: dict[str, object] = {}


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights -> [ceil(N / 32), K, 32] panels (rows past N are zero), the kernel's layout."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL)) if n % PANEL else weight.detach()
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) from pack(W): float32 on a CPU, for the few rows of a decoding step."""
    return torch.ops.specflash_rows.packed_linear(x, packed, n_out, bias)


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU model and its flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(dict.fromkeys(wanted))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _library_name() -> str:
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES), " ".join(FLAGS).encode(), torch.__version__.encode(),
                 _cpu_fingerprint().encode(), sys.version.encode()):
        key.update(part)
    return f"packed_rows-{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
                   *map(str, SOURCES), "-o", str(built), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-600:]}")
        os.replace(built, target)  # atomic: a process building beside this one finds a whole file


def load(cache_dir: Path) -> bool:
    """Build (once per machine, into `cache_dir/kernels`) and load the kernel; False, with one
    message on stderr, where that cannot be done."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    path = Path(cache_dir) / "kernels" / _library_name()
    try:
        if not path.exists():
            print("specflash: building the packed few-row kernel for this CPU (once)", file=sys.stderr)
            _compile(path)
        torch.ops.load_library(str(path))
        _state["loaded"] = True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"specflash: the packed few-row kernel is unavailable ({exc}); PyTorch's kernels are used",
              file=sys.stderr)
        _state["loaded"] = False
    return bool(_state["loaded"])


def loaded() -> bool:
    """Whether `load` built and loaded the library in this process."""
    return bool(_state.get("loaded"))


def fused_node(gi: torch.Tensor, state: torch.Tensor | None, w_hh: torch.Tensor, reads: torch.Tensor,
               read_bias: torch.Tensor | None, rows: torch.Tensor | None, scores: torch.Tensor, alpha: float,
               width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_node.cpp: a GRU cell over `state` after input products `gi`, its readout over a pool
    (the `rows` of the table `reads` + `read_bias`; None: its first rows), fused as scores + alpha *
    short -> (new state, short, fused, the pool positions of the argmax then the top `width`,
    their fused probabilities)."""
    return torch.ops.specflash_fused.fused_node(gi, state, w_hh, reads, read_bias, rows, scores, alpha, width)
