"""mlxft: a correct, fast, memory-light fine-tuning trainer for language models on MLX."""

from mlxft import _blas

_blas.preload()  # must run before anything imports mlx.core

from mlxft import _gpu  # noqa: E402

_gpu.configure()  # before anything can evaluate on the GPU

from mlxft import _heap  # noqa: E402

_heap.keep_freed_buffers()  # before the model's buffers are allocated

from mlxft import _jit  # noqa: E402

_jit.build_for_this_processor()  # before MLX compiles its first CPU kernel

__version__ = "0.1.0"

from mlxft.config import RunConfig  # noqa: E402
from mlxft.errors import UserError  # noqa: E402
from mlxft.trainer import TrainResult, Trainer, fine_tune  # noqa: E402

__all__ = ["RunConfig", "Trainer", "TrainResult", "UserError", "fine_tune"]
