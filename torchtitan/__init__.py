"""A PyTorch-native LLM training platform with fault-tolerant, semi-synchronous training."""

from torchtitan.tools import dependencies, torchft_logs

dependencies.exit_if_missing()
# Before anything here imports torchft: its Rust side reads RUST_LOG once, at import.
torchft_logs.quiet_by_default()
