"""The CUDA dequant-matmul kernel object: repack at load, pick a plan per batch size, launch.

    kernel = CudaGPTQKernel(gptq_weight, torch.float16)   # repacks once (layout.py)
    y = kernel(x, bias)                                    # x [..., in] -> y [..., out]

Plans, chosen per call from the number of rows M (`choose_plan`, from the crossovers measured on
an H200: bench/NOTES-kernels.md):
  * "fused" — csrc/wqa16.cuh: tensor-core MMAs fed by in-register dequantization, M rows in
              blocks of up to 64, the input axis split over the grid until every SM streams;
  * "dense" — dequantize the whole weight to a scratch matrix (csrc dequant_kernel), then cuBLAS:
              large M, where the fused kernel's mma.sync cannot keep up with cuBLAS.

Measured on the H200 this kernel is correct on every plan but not yet faster than the Triton
kernel at batch 1-64 (latency-bound: bench/NOTES-kernels.md), so the registry ranks it below
Triton; FLOTILLA_KERNEL=cuda selects it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..gptq import GPTQWeight
from . import build
from .layout import CudaLayout, UnsupportedCudaLayout, repack

THIN, WIDE = 0, 1  # wqa16.cuh ThinTile (128 n x 128 k), WideTile (256 n x 64 k)
TILE_N = {THIN: 128, WIDE: 256}
TILE_K = {THIN: 128, WIDE: 64}
CONFIGS = [(mb, cfg) for mb in range(1, 5) for cfg in (THIN, WIDE)]
MAX_MB = 4  # 16-row MMA tiles per block
DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1}
OP_LAUNCH, OP_SMEM, OP_OCCUPANCY, OP_PREPARE = 0, 1, 2, 3


class CudaKernelsUnavailable(RuntimeError):
    pass


class _Params(ctypes.Structure):  # wqa16.cuh Params
    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("ws", ctypes.c_void_p), ("counters", ctypes.c_void_p), ("M", ctypes.c_int), ("K", ctypes.c_int),
                ("N", ctypes.c_int), ("K_pad", ctypes.c_int), ("N_pad", ctypes.c_int), ("lda", ctypes.c_int),
                ("ldy", ctypes.c_int), ("splits", ctypes.c_int), ("zero", ctypes.c_int), ("group_magic", ctypes.c_uint32)]


class _DequantParams(ctypes.Structure):  # wqa16.cuh DequantParams
    _fields_ = [("w", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("K_pad", ctypes.c_int), ("N_pad", ctypes.c_int), ("zero", ctypes.c_int),
                ("group_magic", ctypes.c_uint32)]


@dataclass(frozen=True)
class Plan:
    kind: str  # "fused" | "dense"
    mb: int = 1  # 16-row tiles per block
    cfg: int = THIN
    splits: int = 1  # k-splits over the grid

    def grid(self, m: int, n_pad: int) -> int:
        return -(-m // (16 * self.mb)) * self.splits * (n_pad // TILE_N[self.cfg])


# Above this many rows the dense path (dequantize + cuBLAS) is at least as fast as the fused
# kernel on the H200 (bench/NOTES-kernels.md, CUDA run 2: at 256 rows dense wins on every shape).
FUSED_MAX_ROWS = 64


def choose_plan(m: int, k_pad: int, n_pad: int, num_sms: int, occupancy, fused_max_rows: int = FUSED_MAX_ROWS) -> Plan:
    """The plan for M rows, from the H200 sweep (bench/cuda_sweep.py, bench/NOTES-kernels.md).
    `occupancy(mb, cfg)` is the resident blocks per SM of a config. The narrow tile unless its
    tiles alone overfill the resident slots (then the wide one), split along the input axis until
    the grid fills the slots once: one wave, every block streaming from the start."""
    if m > fused_max_rows:
        return Plan("dense")
    mb = min(MAX_MB, -(-m // 16))
    m_blocks = -(-m // (16 * mb))
    cfg = THIN
    if mb > 1 and m_blocks * (n_pad // TILE_N[THIN]) > occupancy(mb, THIN) * num_sms:
        cfg = WIDE
    base = m_blocks * (n_pad // TILE_N[cfg])
    slots = occupancy(mb, cfg) * num_sms
    kt = k_pad // TILE_K[cfg]
    splits = max(1, min(kt, slots // base)) if base < slots else 1
    return Plan("fused", mb, cfg, splits)


class _Library:
    """The ctypes view of one compiled library (csrc/api.cu)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i, p = ctypes.c_int, ctypes.c_void_p
        lib.flotilla_wqa16.argtypes = [i, p, i, i, i, i, i, i, p, ctypes.POINTER(i)]
        lib.flotilla_wqa16.restype = i
        lib.flotilla_dequant.argtypes = [i, p, i, i, i, p]
        lib.flotilla_dequant.restype = i
        lib.flotilla_error_string.argtypes = [i]
        lib.flotilla_error_string.restype = ctypes.c_char_p
        sizes = (ctypes.c_int * 2)()
        lib.flotilla_param_sizes(sizes)
        if (sizes[0], sizes[1]) != (ctypes.sizeof(_Params), ctypes.sizeof(_DequantParams)):
            raise CudaKernelsUnavailable(f"library parameter structs are {tuple(sizes)} bytes, "
                                         f"ctypes has {ctypes.sizeof(_Params)}, {ctypes.sizeof(_DequantParams)}")
        self._occupancy: dict[tuple, int] = {}

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"flotilla CUDA {what} failed: {self.lib.flotilla_error_string(rc).decode()}")

    def fused(self, op: int, params, dtype: int, bits: int, plan: Plan, zp: bool, grid: int = 0, stream=None) -> int:
        out = ctypes.c_int(0)
        rc = self.lib.flotilla_wqa16(op, params, dtype, bits, plan.mb, plan.cfg, int(zp), grid, stream,
                                     ctypes.byref(out))
        self.check(rc, "kernel launch" if op == OP_LAUNCH else "kernel setup")
        return out.value

    def occupancy(self, dtype: int, bits: int, mb: int, cfg: int, zp: bool) -> int:
        key = (dtype, bits, mb, cfg, zp)
        if key not in self._occupancy:
            self._occupancy[key] = max(1, self.fused(OP_OCCUPANCY, None, dtype, bits, Plan("fused", mb, cfg), zp))
        return self._occupancy[key]


_libraries: dict[tuple[int, int], _Library] = {}


def library(device: torch.device) -> _Library | None:
    """The compiled kernels for this GPU, or None (no nvcc, a failed build, a GPU below sm_80)."""
    cap = torch.cuda.get_device_capability(device)
    if cap not in _libraries:
        lib = build.load(cap)
        if lib is None:
            return None
        _libraries[cap] = _Library(lib)
    return _libraries[cap]


class CudaGPTQKernel:
    """y = x @ W for one GPTQ linear, in fp16 or bf16, on an NVIDIA GPU of compute capability 8.0+."""

    name = "cuda"

    def __init__(self, w: GPTQWeight, dtype: torch.dtype, fused_max_rows: int = FUSED_MAX_ROWS):
        device = w.qweight.device
        if device.type != "cuda":
            raise UnsupportedCudaLayout(f"the CUDA kernels need a CUDA tensor, not {device.type}")
        lib = library(device)
        if lib is None:
            raise CudaKernelsUnavailable("the flotilla CUDA kernels could not be built for this GPU")
        self.lib = lib
        self.layout: CudaLayout = repack(w, dtype)
        self.dtype = dtype
        self.fused_max_rows = fused_max_rows
        self._dt = DTYPE_CODE[dtype]
        self._zp = self.layout.zeros is not None
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Split-K runs at most one wave of blocks, so a tile counter per resident block suffices.
        self._counters = torch.zeros(8 * self.num_sms, dtype=torch.int32, device=device)
        self._plans: dict[int, Plan] = {}
        for mb, cfg in CONFIGS:  # before any graph capture: shared-memory limits, module load
            lib.fused(OP_PREPARE, None, self._dt, self.layout.bits, Plan("fused", mb, cfg), self._zp)
        lib.check(lib.lib.flotilla_dequant(OP_PREPARE, None, self._dt, self.layout.bits, int(self._zp), None),
                  "dequant setup")

    def occupancy(self, mb: int, cfg: int) -> int:
        return self.lib.occupancy(self._dt, self.layout.bits, mb, cfg, self._zp)

    def plan_for(self, m: int) -> Plan:
        plan = self._plans.get(m)
        if plan is None:
            lay = self.layout
            plan = self._plans[m] = choose_plan(m, lay.k_pad, lay.n_pad, self.num_sms, self.occupancy,
                                                self.fused_max_rows)
        return plan

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, plan: Plan | None = None) -> torch.Tensor:
        lay = self.layout
        if x.dtype != self.dtype:
            raise ValueError(f"activation dtype {x.dtype} does not match the kernel's {self.dtype}")
        if x.shape[-1] != lay.in_features:
            raise ValueError(f"activation has {x.shape[-1]} input features, the weight expects {lay.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, lay.in_features)
        if lay.perm is not None:
            x2 = x2.index_select(1, lay.perm)  # the kernels read rows in the sorted (group) order
        elif x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
            x2 = x2.contiguous()
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        m = x2.shape[0]
        plan = plan or self.plan_for(m)
        if m == 0:
            y = x2.new_empty((0, lay.out_features))
        elif plan.kind == "dense":
            w = self.dequantize()[: lay.in_features, : lay.out_features]
            y = torch.matmul(x2, w) if bias is None else torch.addmm(bias, x2, w)
        else:
            y = self._fused(x2, bias, plan)
        return y.reshape(*lead, lay.out_features)

    def _fused(self, x2: torch.Tensor, bias: torch.Tensor | None, plan: Plan) -> torch.Tensor:
        lay = self.layout
        m = x2.shape[0]
        y = torch.empty((m, lay.out_features), dtype=self.dtype, device=x2.device)
        grid = plan.grid(m, lay.n_pad)
        ws = None
        if plan.splits > 1:
            tiles = grid // plan.splits
            if tiles > self._counters.numel():
                raise ValueError(f"plan {plan} has {tiles} tiles, more than the {self._counters.numel()} split-K counters")
            ws = torch.empty(plan.splits * m * lay.n_pad, dtype=torch.float32, device=x2.device)
        p = _Params(x=x2.data_ptr(), w=lay.words.data_ptr(), scales=lay.scales.data_ptr(),
                    zeros=lay.zeros.data_ptr() if lay.zeros is not None else None,
                    bias=bias.data_ptr() if bias is not None else None, y=y.data_ptr(),
                    ws=ws.data_ptr() if ws is not None else None, counters=self._counters.data_ptr(),
                    group_magic=lay.group_magic, M=m, K=lay.in_features, N=lay.out_features, K_pad=lay.k_pad,
                    N_pad=lay.n_pad, lda=x2.stride(0), ldy=y.stride(0), splits=plan.splits, zero=lay.zero_const)
        stream = ctypes.c_void_p(torch.cuda.current_stream(x2.device).cuda_stream)
        self.lib.fused(OP_LAUNCH, ctypes.byref(p), self._dt, lay.bits, plan, self._zp, grid, stream)
        return y

    def dequantize(self) -> torch.Tensor:
        """The dense weight [k_pad, n_pad] in the kernel's dtype, rows in the sorted (group) order."""
        lay = self.layout
        out = torch.empty((lay.k_pad, lay.n_pad), dtype=self.dtype, device=lay.words.device)
        p = _DequantParams(w=lay.words.data_ptr(), scales=lay.scales.data_ptr(),
                           zeros=lay.zeros.data_ptr() if lay.zeros is not None else None, out=out.data_ptr(),
                           group_magic=lay.group_magic, K_pad=lay.k_pad, N_pad=lay.n_pad, zero=lay.zero_const)
        stream = ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)
        rc = self.lib.lib.flotilla_dequant(OP_LAUNCH, ctypes.byref(p), self._dt, lay.bits, int(self._zp), stream)
        self.lib.check(rc, "dequant launch")
        return out


def make_kernel(w: GPTQWeight, dtype: torch.dtype):
    """Registry factory: the CUDA kernel, else the Triton one where Triton is installed, else the
    dense kernel (the reference's numbers through cuBLAS)."""
    from ..reference import DenseKernel
    from ..triton_linear import make_kernel as triton_kernel, triton_available

    if dtype in DTYPE_CODE:
        try:
            return CudaGPTQKernel(w, dtype)
        except (UnsupportedCudaLayout, CudaKernelsUnavailable):
            pass
    return triton_kernel(w, dtype) if triton_available() else DenseKernel(w, dtype)


def supports(device: torch.device, bits: int) -> bool:
    """Whether the kernels could serve this GPU, without building them: the registry asks every
    entry before it picks the highest ranked, so a build here would run nvcc (minutes, or a
    warning) on every GPU start that then uses Triton. The build happens in `make_kernel` once
    the entry is chosen; a failed one falls back to Triton there."""
    device = torch.device(device)
    return (device.type == "cuda" and bits in (4, 8) and torch.cuda.is_available()
            and tuple(torch.cuda.get_device_capability(device)) >= build.MIN_CAPABILITY)
