"""Train from a Python script: the same run as the CLI, in three lines.

    python examples/train_from_python.py MODEL_DIR DATA_DIR
"""

import sys

from mlxft import RunConfig, fine_tune

config = RunConfig.from_dict({"model": {"model": sys.argv[1]}, "data": {"data": sys.argv[2]}, "train": {"output_dir": "runs/from-python"}})
result = fine_tune(config)
print(f"trained {result.steps} steps; validation loss {result.val_loss}; run directory {result.run_dir}")
