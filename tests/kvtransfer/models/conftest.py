import pytest
import torch

from tests.kvtransfer.models._support import require_smollm2


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_raw():
    """(reader, config, dequantized GGUF arrays) of SmolLM2, read once per session."""
    from kvtransfer.models import gguf_llama

    reader = gguf_llama.open_gguf(require_smollm2())
    config = gguf_llama.read_config(reader)
    return reader, config, gguf_llama.dequantize_all(reader)


@pytest.fixture(scope="session")
def smollm2(smollm2_raw):
    """(ModelSpec, GGUFTokenizer) of SmolLM2."""
    from kvtransfer.models import gguf_llama
    from kvtransfer.models.config import ModelName
    from kvtransfer.models.registry import ModelSpec
    from kvtransfer.models.tokenizer import GGUFTokenizer

    reader, config, raw = smollm2_raw
    return ModelSpec(ModelName.SMOLLM2, config, gguf_llama.to_llama_weights(raw, config)), GGUFTokenizer(reader)
