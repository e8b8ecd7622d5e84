"""EAGLE-3 draft-training data: prefill a target model, keep chosen layers' hidden states."""

__version__ = "0.1.0"
