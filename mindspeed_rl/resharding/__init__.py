"""Resharding flow: the actor's weights between training (TP x PP x DP) and generation (TP_g x DP_g)."""

from mindspeed_rl.resharding.ledger import ByteLedger, TransitionReport
from mindspeed_rl.resharding.resharder import MODES, Resharder
from mindspeed_rl.resharding.swap import StateSwapper, training_state_tensors
from mindspeed_rl.resharding.weight_stream import ReshardingError, TrainingGroups, WeightStream

__all__ = ["ByteLedger", "MODES", "ReshardingError", "Resharder", "StateSwapper",
           "TrainingGroups", "TransitionReport", "WeightStream", "training_state_tensors"]
