"""Plain ``nn.Module`` language models (no Lightning imports)."""

from lit_dtrain.models.llama import Block, Llama, LlamaConfig, RMSNorm

__all__ = ["Block", "Llama", "LlamaConfig", "RMSNorm", "build_llama"]


def build_llama(**kwargs) -> Llama:
    """Build a :class:`Llama` from flat config keys (what ``conf/model/*.yaml`` holds)."""
    return Llama(LlamaConfig.from_dict(kwargs))
