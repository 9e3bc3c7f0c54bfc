"""Shared fixtures. The tiny model is built once per recipe into the cache (~5 s)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_dir():
    import data
    return data.tiny_model_dir()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_dir)
