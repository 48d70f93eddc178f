"""RL algorithms: group advantages, the policy loss, replay and prompt selection."""

from rlx.rl.advantages import group_advantages
from rlx.rl.loss import LossConfig, policy_loss
