"""GPT-2 causal language-model pretraining template (see README.md)."""
