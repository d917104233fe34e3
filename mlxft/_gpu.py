"""MLX settings that only count before the first evaluation, made when mlxft is imported.

All are environment variables MLX reads once, at that evaluation; a value already set (by
the user, or a parent process) is kept. Nothing here evaluates anything on the device.
"""

from __future__ import annotations

import os

import mlx.core as mx

GRAPH_CACHE_VARIABLE = "MLX_CUDA_GRAPH_CACHE_SIZE"
GRAPH_MB_VARIABLE = "MLX_MAX_MB_PER_BUFFER"
GRAPH_MB = 200
# A checkpointed step keeps little besides what its graphs hold, so a smaller cap pays there:
# on the H200 100M took Llama-3.2-1B chat from 9.09 to 8.49 GB at 31.1k against 31.3k tokens/s,
# and 50M its longest step (--loss-chunk 512) from 3.94 to 3.37 GB over the weights at 82 ms a step either way.
CHECKPOINTED_GRAPH_MB = 50
# Recomputing only the MLPs keeps more activations, so the cap is halved rather than quartered: on
# the H200 (chat, --loss-chunk 512, --recompute-mlp) 100M took the unpaced peak from 6.95 to 5.86 GB
# (Llama-3.2-1B) and 7.12 to 6.18 (LFM2-1.2B), paced 5.21 to 5.15 and 5.66 to 5.57, at tokens/s
# within the runs' spread; 50M cut Llama's unpaced peak to 5.45 GB but ran 10% slower there.
RECOMPUTED_MLP_GRAPH_MB = 100
# Compute capabilities where MLX's own cap is above GRAPH_MB (in its recent sources 1000M on
# H100, B200 and consumer Blackwell, 400M on A100); elsewhere it is 100M or less, left alone.
_LARGE_GRAPH_DEVICES = {(8, 0), (9, 0), (10, 0), (12, 0)}
EVAL_WIDTH_VARIABLE = "MLX_BFS_MAX_WIDTH"
# The cap mlxft chose, kept beside it so that a child process (a benchmark's trainers, ranks
# under mlx.launch) still tells mlxft's choice from the user's.
CHOSEN_VARIABLE = "MLXFT_GRAPH_MB_CHOSEN"


def configure() -> None:
    # MLX's CUDA backend drops *all* its instantiated CUDA graphs once it holds 100, which
    # variable-length batches reach within a few steps: Llama-3.2-1B chat SFT on an H200 ran
    # at 18.8k tok/s with the default and 29.5k with 1000.
    os.environ.setdefault(GRAPH_CACHE_VARIABLE, "1000")
    narrow_evaluation()
    # device_info() was checked on an H200 not to fix MLX's choice of graph size.
    try:
        info = device_info()
    except Exception:  # a CUDA build with no usable device must still import; MLX says why later
        info = {}
    cap_graph_inputs(info)


def narrow_evaluation() -> None:
    """Have MLX evaluate a graph one branch at a time (``MLX_BFS_MAX_WIDTH=1``; MLX's default is 20)
    on CUDA and the CPU.

    MLX orders the operations it evaluates breadth first, up to that many branches side by
    side, and every branch's intermediate arrays are alive until it is done. The recomputed
    layers of a checkpointed step are such branches: on the H200, chat with --grad-checkpoint
    --loss-chunk 512 peaked at 3.99 against 4.66 GB (LFM2-1.2B) and 4.42 against 6.17
    (Llama-3.2-1B), at the same step times; on the CPU 0.98 against 1.02 GB (SmolLM2-135M).
    Metal encodes independent kernels for concurrent dispatch, which a narrower order could
    cost, and is left alone until it is measured there."""
    if not mx.metal.is_available():
        os.environ.setdefault(EVAL_WIDTH_VARIABLE, "1")


def device_info() -> dict:
    """MLX's description of its device (name, memory, a CUDA compute capability); {} where it has none."""
    if hasattr(mx, "device_info"):
        return mx.device_info()
    return mx.metal.device_info() if mx.metal.is_available() else {}  # MLX before device_info()


def cap_graph_inputs(device_info: dict, mb: int = GRAPH_MB) -> None:
    """Close MLX's CUDA graphs after ``mb`` million input elements where MLX would wait longer.

    A graph keeps every buffer its kernels read until the whole graph has run, so the cap
    bounds how much finished work is still allocated at the peak: on an H200, LFM2-1.2B at
    T=512 peaked at 13.2 GB with 200 against 19.5 with MLX's default, at the same tokens/s.
    Only CUDA devices report a compute capability; Metal sizes its command buffers itself.
    """
    capability = (device_info.get("compute_capability_major"), device_info.get("compute_capability_minor"))
    if GRAPH_MB_VARIABLE not in os.environ and capability in _LARGE_GRAPH_DEVICES:
        os.environ[GRAPH_MB_VARIABLE] = os.environ[CHOSEN_VARIABLE] = str(mb)


def cap_for_checkpointing(mb: int = CHECKPOINTED_GRAPH_MB) -> None:
    """Lower mlxft's own cap to ``mb`` for a run that recomputes its layers (or, with
    RECOMPUTED_MLP_GRAPH_MB, its MLPs). Effective only before the first GPU evaluation: the
    trainer calls it before it loads the model."""
    chosen = os.environ.get(CHOSEN_VARIABLE)
    if chosen is not None and os.environ.get(GRAPH_MB_VARIABLE) == chosen:
        os.environ[GRAPH_MB_VARIABLE] = os.environ[CHOSEN_VARIABLE] = str(mb)


def cap_for_recomputation(grad_checkpoint: bool, recompute_mlp: bool) -> None:
    """:func:`cap_for_checkpointing` at the cap for what the run recomputes (nothing: no change)."""
    if grad_checkpoint:
        cap_for_checkpointing(CHECKPOINTED_GRAPH_MB)
    elif recompute_mlp:
        cap_for_checkpointing(RECOMPUTED_MLP_GRAPH_MB)
