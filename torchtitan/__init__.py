"""A PyTorch-native LLM training platform with fault-tolerant, semi-synchronous training."""
