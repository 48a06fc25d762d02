"""fleetscope: see inside ML jobs across a GPU fleet."""
import os as _os

# One BLAS thread per process: the model's small matrix operations run
# hundreds of times slower when OpenBLAS spreads them over threads on a loaded
# host (measured: 4.5 ms per small triangular solve on a busy 2-core VM).
# Set before numpy loads; an operator's explicit setting wins.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")
