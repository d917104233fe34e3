"""Run another script with some of mlxft's fused functions switched off: an A/B of what each saves and costs.

    python scripts/unfused.py conv scripts/step_time_by_size.py --model config:lfm2-1.2b
    python scripts/unfused.py attention,conv scripts/bench.py --workload chat --only mlxft

``conv``: LFM2's short convolution as mlx-lm computes it (not ``fastmath.short_conv_lora``);
``attention``: the attention modules as mlx-lm computes them (not ``fastmath.attention_lora``).
Only in this process: a benchmark's pairs run each trainer in a process of its own, so use
``--only mlxft`` there.
"""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxft  # noqa: E402,F401 - optimized BLAS before MLX on Linux
from mlxft import fastmath, models  # noqa: E402


def _beneath(marker):
    def call(self, x, mask=None, cache=None):
        return models.call_beneath(self, marker)(self, x, mask=mask, cache=cache)

    return call


SWITCHES = {"conv": ("_short_conv_call", fastmath._SHORT_CONV), "attention": ("_attention_call", fastmath._ATTENTION)}

if len(sys.argv) < 3 or not set(sys.argv[1].split(",")) <= SWITCHES.keys():
    sys.exit(f"usage: {sys.argv[0]} {{{','.join(SWITCHES)}}}[,...] SCRIPT [ARGS...]")
for name in sys.argv[1].split(","):
    function, marker = SWITCHES[name]
    setattr(fastmath, function, _beneath(marker))
script, sys.argv = sys.argv[2], sys.argv[2:]
sys.path.insert(0, str(Path(script).resolve().parent))
runpy.run_path(script, run_name="__main__")
