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
