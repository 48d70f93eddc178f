"""Decoder-only language models (Llama / Qwen / Gemma families)."""

from rlx.model.config import ModelConfig
from rlx.model.transformer import (AttentionSpec, Transformer, abstract_params, apply, bind,
                                   graphdef_for, init_params, token_logprobs)
