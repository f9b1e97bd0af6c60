"""BERT masked-LM pretraining."""
