"""Train from a Python script: the same run as the CLI.

    python examples/train_from_python.py MODEL_DIR DATA_DIR [OUTPUT_DIR]

Bad input (a missing file, an output directory that already holds a run) raises
``mlxft.errors.UserError``, whose message is the one line the CLI prints.
"""

import sys

from mlxft import RunConfig, fine_tune
from mlxft.errors import UserError

model, data, output_dir = (sys.argv[1:] + ["runs/from-python"])[:3]
config = RunConfig.from_dict({"model": {"model": model}, "data": {"data": data}, "train": {"output_dir": output_dir}})
try:
    result = fine_tune(config)
except UserError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
print(f"trained {result.steps} steps; validation loss {result.val_loss}; run directory {result.run_dir}")
