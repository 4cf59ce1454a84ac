"""Training: tokenizer, datasets and the training loop."""
