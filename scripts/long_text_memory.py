"""Peak memory and time of loading one long text row: the tokenizer's share of it.

    python scripts/long_text_memory.py 10     # a 10 MB row of English-like words, SmolLM2's tokenizer

Writes the row to a temporary directory once; prints the windows, tokens, seconds, the process's
peak resident memory and a digest of the token ids (equal digests: equal tokens).
"""
import hashlib
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlxft  # noqa: E402,F401
import numpy as np  # noqa: E402
from mlxft import builtin  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402
from mlxft.data import load_dataset  # noqa: E402

mb = float(sys.argv[1])
path = Path(tempfile.gettempdir()) / f"mlxft-long-text-{mb}.jsonl"
if not path.exists():
    rng = random.Random(0)
    words = ("the of and a to in is you that it he was for on are as with his they I at be this have from or one "
             "had by word but not what all were we when your can said there use an each which she do how their if "
             "will up other about out many then them these so some her would make like him into time has look two "
             "more write go see number no way could people my than first water been call who oil its now find long "
             "down day did get come made may part").split()
    parts, size = [], 0
    while size < mb * 1e6:
        w = rng.choice(words) + rng.choice([" ", " ", " ", ", ", ".\n", "\n\n", " — ", " 42 "])
        parts.append(w)
        size += len(w)
    path.write_text(json.dumps({"text": "".join(parts)}) + "\n")
tok = load_tokenizer(Path(builtin.resolve("builtin:smollm2-135m-instruct")))
t = time.time()
ds = load_dataset(path, tok, 2048)
print(f"{mb} MB: {len(ds.examples)} windows, {sum(len(e.ids) for e in ds.examples)} tokens, {time.time()-t:.1f} s, "
      f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e6:.2f} GB")
print(hashlib.sha256(np.concatenate([e.ids for e in ds.examples]).tobytes()).hexdigest()[:16])
