"""Evaluation: held-out perplexity by our model and through Hugging Face, greedy samples."""
