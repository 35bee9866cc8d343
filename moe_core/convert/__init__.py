"""Checkpoint formats: our model directory and Hugging Face OLMoE."""
