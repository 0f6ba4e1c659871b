"""Floor 2, the models: the actor-critic interface and its implementations (the shared value head, a policy with a
critic of its own), the critic in one place (`critics`: build, load, save), `from_pretrained` with quantization (the
only bitsandbytes importer), tokenizers (pad, stop, vocabulary), LoRA adapters, loading the policy and the reference
(`policy`) and the reward model(s) (`reward_model`), and GGUF checkpoints."""

from .actor_critic import ActorCritic, CausalLMOutputWithValue, PolicyAndCritic
from .adapters import adapter_config, prepare_adapters, save_policy
from .critics import CriticLoading, SavedCritic, ValueModel, load_critic, save_critic, saved_critic
from .policy import load_policy, load_reference, without_critic
from .pretrained import compute_dtype, disable_dropout, freeze, from_pretrained, quantization_config
from .reward_model import RewardLoading, load_reward_model, load_rewards
from .tokenizers import choose_pad_token, load_policy_tokenizer, load_tokenizer, resolve_stop_token_ids
from .value_head import AutoModelForCausalLMWithValueHead, ValueHead

__all__ = ["ActorCritic", "AutoModelForCausalLMWithValueHead", "CausalLMOutputWithValue", "CriticLoading",
           "PolicyAndCritic", "RewardLoading", "SavedCritic", "ValueHead", "ValueModel", "adapter_config",
           "choose_pad_token", "compute_dtype", "disable_dropout", "freeze", "from_pretrained", "load_critic",
           "load_policy", "load_policy_tokenizer", "load_reference", "load_reward_model", "load_rewards",
           "load_tokenizer", "prepare_adapters", "quantization_config", "resolve_stop_token_ids", "save_critic",
           "save_policy", "saved_critic", "without_critic"]
