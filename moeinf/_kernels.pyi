# Stub of the C++ extension (csrc/kernels_bindings.cpp); tests/test_engine_stub.py checks it against the
# module.
# Addresses are those of tensors moeinf.runtime.gemv has checked; see csrc/gemv.hpp for the layouts.
import enum

class DType(enum.Enum):
    float32 = 0
    bfloat16 = 1
    float16 = 2

class Workers:
    def __init__(self, threads: int) -> None: ...
    @property
    def threads(self) -> int: ...

def supported() -> bool: ...
def int8_rowwise_gemv(x: int, io_type: DType, rows: int, q: int, scale: int, scale_type: DType, out: int,
                      n: int, k: int, workers: Workers | None, quantise_x: bool = False) -> None: ...
def int4_packed_gemv(x: int, io_type: DType, rows: int, packed: int, scale_zero: int, scale_type: DType,
                     out: int, n: int, k: int, group: int, workers: Workers | None,
                     quantise_x: bool = False) -> None: ...
def rms_norm(x: int, weight: int, eps: float, type: DType, rows: int, n: int, out: int) -> None: ...

class MlaShape:
    def __init__(self, heads: int, nope: int, rope: int, rank: int, v: int) -> None: ...

def mla_prepare(q: int, latent: int, norm_weight: int, eps: float, cos: int, sin: int, interleave: bool,
                type: DType, shape: MlaShape, q_out: int, kv_out: int, k_rot_out: int) -> None: ...
def mla_attend(q: int, latents: int, k_rot: int, T: int, w_uk: int, w_uv_t: int, scaling: float, mask: int,
               type: DType, shape: MlaShape, out: int) -> None: ...
