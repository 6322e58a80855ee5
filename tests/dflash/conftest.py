"""Shared fixtures for the dflash tests: the built-in tiny target and a small corpus, built once."""

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).parent / "data"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Run the dflash tests on one intra-op thread. The test models' ops are tiny, and on a shared
    2-core box a second OpenMP thread spins at barriers while the other core is busy: measured
    140 s instead of ~1 s for six short greedy generations of the tiny target."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """tests/dflash/data: small JSONL fixtures (good and bad records)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def tiny_target_dir(small_builtin) -> Path:
    """HF directory of the built-in tiny Qwen3 target (seed 0), built once per session: the one the
    small runs' built-ins hold (tests/conftest.py), not a second build of the same. Read only."""
    return small_builtin / "tiny-target"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    """The tiny target's tokenizer, loaded with AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_corpus(small_builtin) -> Path:
    """48 built-in conversations (seed 0) whose assistant turns are the tiny target's greedy output: the
    training corpus of the small runs' built-ins (`build_builtin_corpus` with these arguments). Read only."""
    return small_builtin / "train.jsonl"
