"""Plain ``nn.Module`` language models (no Lightning imports)."""

from lit_dtrain.models.llama import Block, Llama, LlamaConfig, RMSNorm

__all__ = ["Block", "Llama", "LlamaConfig", "RMSNorm"]
