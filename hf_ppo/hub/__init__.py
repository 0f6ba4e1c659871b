"""Floor 5, what leaves the machine: the policy folder and its push (`publish`), a critic pushed to a repo of its own,
the model cards (`cards`, with the template in `templates/`) and the training-curve plots (`plots`)."""

from .cards import PublishSettings, write_critic_card, write_model_card, write_policy_card
from .plots import plot_training_curves
from .publish import HubPushError, push_critic, push_policy_folder, save_merged_policy, save_policy_folder

__all__ = ["HubPushError", "PublishSettings", "plot_training_curves", "push_critic", "push_policy_folder", "save_merged_policy",
           "save_policy_folder", "write_critic_card", "write_model_card", "write_policy_card"]
