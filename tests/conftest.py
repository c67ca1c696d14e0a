"""Shared fixtures. Unit tests use one torch thread: on 2 shared vCPUs, 2 threads can be 30x slower."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted embedded SmolLM2 folder (converted once per machine into ~/.cache/kvbench)."""
    from kvbench.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))
