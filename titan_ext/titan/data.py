"""The tiny local text dataset and tokenizer shipped with titan_ext (nothing is downloaded).

``[training] dataset = "titan_ext_tiny"`` selects the generated corpus in
``titan_ext/titan/assets/corpus.jsonl`` (see :mod:`titan_ext.titan.assets_gen`);
``[model] hf_assets_path`` should point at ``titan_ext/titan/assets/tokenizer`` (a byte-level BPE with
1152 tokens, which fits the llama3 debug model's vocab_size of 2048).
The dataset is registered in TorchTitan's ``DATASETS`` table by :func:`register_dataset` (called by
``titan_ext.titan.register``); it is loaded from the local file into an in-memory
``datasets.Dataset`` -- no hub access.
"""

import json
from pathlib import Path

from titan_ext.titan.assets_gen import CORPUS_PATH, TOKENIZER_DIR

__all__ = ["DATASET_NAME", "CORPUS_PATH", "TOKENIZER_DIR", "load_corpus", "register_dataset"]

DATASET_NAME = "titan_ext_tiny"


def load_corpus(path: str | Path = CORPUS_PATH):
    """The corpus as an in-memory ``datasets.Dataset`` with one "text" column."""
    from datasets import Dataset

    path = Path(path)
    if path.is_dir():
        path = path / "corpus.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"titan_ext corpus not found: {path}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(rows)


def _text(sample: dict) -> str:
    return sample["text"]


def register_dataset() -> None:
    """Add ``titan_ext_tiny`` to TorchTitan's dataset table (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=str(CORPUS_PATH), loader=load_corpus, sample_processor=_text
    )
