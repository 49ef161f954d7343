"""PyTorch models: the target (Llama forward with explicit KV), the drafters, their losses, runners."""
