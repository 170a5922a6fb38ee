"""Whole models: a classification encoder and a causal decoder over any attention pattern."""

from sparsefocus.models.config import ModelConfig, block_patterns, mechanism_label
from sparsefocus.models.decoder import Decoder
from sparsefocus.models.encoder import Encoder

__all__ = ["Decoder", "Encoder", "ModelConfig", "block_patterns", "mechanism_label"]
