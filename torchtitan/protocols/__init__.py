from torchtitan.protocols.train_spec import ModelArgs, TrainSpec

__all__ = ["ModelArgs", "TrainSpec"]
