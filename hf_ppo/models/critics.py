"""The critic in one place: what it is, how it is built, and how it outlives the run.

`ValueModel` is a critic with a body of its own: a causal backbone and an fp32 value head, either a separate model
('separate', started from `critic_model` or the reward model) or a LoRA adapter on the reward model's frozen base
('reward_lora'). `load_critic` builds the one `PPOConfig.critic` asks for (the shared value head on the policy is
`value_head.py`'s). The critic reads the policy's token ids, so a source with another vocabulary is refused here.

`save_critic` writes a trained critic to a folder, `saved_critic` reads one back
when it is passed as the trainer's `critic_model`, so a critic fitted in one run starts the next.

The folder holds `critic.safetensors` (exactly the critic state a checkpoint stores: the shared value head; a
critic's LoRA adapter + value head; or a fully fine-tuned critic's every weight) and `hf_ppo_critic.json` (which
`critic` it is and, for a LoRA critic, the id/path of the base it sits on). Beside them, in the formats other tools
read: a fully fine-tuned `"separate"` critic is also a one-label sequence-classification model (config.json +
weights; the value head is its score layer, whose bias, which a score layer lacks, is in critic.safetensors); a LoRA
critic is also a PEFT adapter folder (in the subfolder `critic/`, PEFT's layout for an adapter named "critic").
hf_ppo reloads from critic.safetensors, so the values are bitwise the saved critic's. hf_ppo_critic.json also lists
the files written: a later save replaces exactly those (refusing a folder with other files), and a load names any of
them that is missing or damaged. A save writes into a sibling folder and swaps it in whole, so a killed save leaves
the earlier critic (or none, for a first save), never half a file.
`hf_ppo.hub.push_critic` (and `trainer.push_critic_to_hub`) pushes such a folder to a Hub repo of its own; `saved_critic` reads that repo back by id.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from ..runtime.files import file_problem
from ..runtime.versions import GradientCheckpointingNames, checkpointing_disable, checkpointing_enable
from .pretrained import _init_kwargs, _is_quantized, _shares_parameters, from_pretrained, pools_itself
from .tokenizers import check_vocab, load_reward_tokenizer, load_tokenizer, same_checkpoint

CRITIC_STATE_FILE = "critic.safetensors"
CRITIC_INFO_FILE = "hf_ppo_critic.json"


def save_critic(model: nn.Module, folder: str, tokenizer=None) -> str:
    """Write the critic of `model` (an `AutoModelForCausalLMWithValueHead`: its shared value head, or a
    `PolicyAndCritic`: its `ValueModel`) to `folder`; return the folder. `folder` must be new, empty, or a critic
    saved before (which is replaced, whole: none of its files stay beside the new critic's): a critic's config.json
    and weights would overwrite a model saved there, and files save_critic did not write are never deleted. A fully
    fine-tuned critic is a model folder, which needs its tokenizer (the policy's: a critic reads the policy's token
    ids): pass `tokenizer`.

    The critic is written into a sibling folder and swapped in when complete, so a save killed at any point leaves
    the earlier critic (or the new one), never a half-written file."""
    state = model.critic_state_dict()
    value_model = getattr(model, "critic", None)  # a critic with a body of its own; the shared head has none
    if not state:
        raise ValueError("This run has no critic to save (a critic-free advantage_estimator).")
    full = value_model is not None and not hasattr(value_model.backbone, "peft_config")
    if full and tokenizer is None:
        raise ValueError("A fully fine-tuned critic is saved as a model folder, with the tokenizer a later run checks "
                         "its vocabulary against: pass the policy's tokenizer, "
                         "trainer.model.save_critic(folder, trainer.processing_class).")
    target = os.path.normpath(os.fspath(folder))
    _recover(target)
    _check_replaceable(target)
    partial = target + _PARTIAL
    shutil.rmtree(partial, ignore_errors=True)  # left by a save killed before its swap: hf_ppo's own name
    os.makedirs(partial)
    info = {"critic": "shared", "base": None}
    if value_model is not None:
        info = {"critic": value_model.kind, "base": value_model.source}
        if full:
            _save_sequence_classifier(value_model, partial)
            tokenizer.save_pretrained(partial)
        else:
            value_model.backbone.save_pretrained(partial)  # the adapter, in folder/critic/ (its adapter name)
    save_file(state, os.path.join(partial, CRITIC_STATE_FILE), metadata={"format": "pt"})
    # The files written, so a later save replaces exactly these and a load can tell a damaged folder.
    info["files"] = sorted([*_files_in(partial), CRITIC_INFO_FILE])
    with open(os.path.join(partial, CRITIC_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
    _swap_in(partial, target)
    return folder


# Siblings of a critic folder while it is saved: the new critic until complete, the earlier one until replaced.
_PARTIAL, _REPLACED = ".hf_ppo-partial", ".hf_ppo-replaced"
# What save_critic wrote before it recorded its files (`info["files"]`): replaced, never foreign.
_LEGACY_CRITIC_FILES = (CRITIC_STATE_FILE, CRITIC_INFO_FILE, "README.md", "critic/*", "config.json",
                        "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                        "tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                        "vocab.*", "merges.txt", "spiece.model")


def _files_in(folder: str) -> list[str]:
    """Every file under `folder`, as paths relative to it with '/' separators."""
    return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                  for d, _, names in os.walk(folder) for f in names)


def _recover(target: str) -> None:
    """A save killed between its two renames left the earlier critic beside `target`: put it back."""
    replaced = target + _REPLACED
    if os.path.isdir(replaced):
        if os.path.exists(target):
            shutil.rmtree(replaced)  # the swap completed; only the removal of the earlier critic was cut short
        else:
            os.replace(replaced, target)


def _check_replaceable(target: str) -> None:
    """`target` may take a critic: absent, empty, or a critic save_critic wrote with no other file beside it."""
    if not os.path.isdir(target):
        if os.path.exists(target):
            raise ValueError(f"save_critic: {target!r} is a file, not a folder. Give the critic a folder of its own, "
                             "e.g. os.path.join(output_dir, 'critic').")
        return
    present = _files_in(target)
    if not present:
        return
    fix = "Give the critic a folder of its own, e.g. os.path.join(output_dir, 'critic')"
    if CRITIC_INFO_FILE not in present:
        raise ValueError(f"save_critic: {target!r} already holds files that no save_critic wrote ({_some(present)}): a "
                         "policy saved there would be overwritten by the critic's config and weights. " + fix + ".")
    try:
        info = _read_info(target)
    except ValueError:
        info = {}
    ours = info.get("files")
    foreign = [name for name in present if (name not in ours if isinstance(ours, list) else
                                            not any(fnmatch.fnmatch(name, p) for p in _LEGACY_CRITIC_FILES))]
    if foreign:
        raise ValueError(f"save_critic: {target!r} holds a critic saved before, and files that save_critic did not "
                         f"write ({_some(foreign)}): replacing the critic would delete them. {fix}, or move those "
                         "files out first.")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _swap_in(partial: str, target: str) -> None:
    """Move the complete critic at `partial` to `target`, replacing the critic there: at every instant one of the two
    is complete, at `target` or (between the renames) at `target + _REPLACED`, where the next save or load finds it."""
    if os.path.isdir(target) and not os.listdir(target):
        os.rmdir(target)
    if not os.path.exists(target):
        os.replace(partial, target)
        return
    replaced = target + _REPLACED
    os.replace(target, replaced)
    os.replace(partial, target)
    shutil.rmtree(replaced)


def _save_sequence_classifier(value_model: nn.Module, folder: str) -> None:
    """A fully fine-tuned critic as the one-label sequence classifier it reads as: its backbone, the value head's
    weight as the score layer."""
    from transformers import AutoModelForSequenceClassification

    backbone = value_model.backbone
    config = backbone.config.__class__.from_dict(backbone.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = backbone.config.pad_token_id
    with torch.device("meta"):
        classifier = AutoModelForSequenceClassification.from_config(config, dtype=backbone.dtype)
    getattr(classifier, classifier.base_model_prefix).load_state_dict(backbone.state_dict(), assign=True)
    weight = value_model.head.weight.detach().to(backbone.dtype)
    classifier.score.weight = nn.Parameter(weight.reshape(classifier.score.weight.shape).clone(), requires_grad=False)
    classifier.save_pretrained(folder)


@dataclass
class SavedCritic:
    """A critic `save_critic` wrote: its `critic` kind, its state, and what to build the critic from before the
    state is loaded (`build_from`: the folder itself for a fully fine-tuned critic, the recorded base of a LoRA
    critic, or None: as the run would without critic_model)."""

    critic: str
    state: dict[str, torch.Tensor]
    build_from: str | None


def saved_critic(critic_model, critic: str, init_kwargs: dict | None = None) -> SavedCritic | None:
    """The saved critic when `critic_model` is a folder `save_critic` wrote, or the id of a Hub repo
    `push_critic_to_hub` pushed (downloaded; from the cache with HF_HUB_OFFLINE=1), else None (an ordinary critic
    source). `init_kwargs` (`critic_model_init_kwargs`): its `revision`, `token` and `cache_dir` apply to the
    download. Its kind must be this run's `critic`; an error says which to set."""
    if not isinstance(critic_model, (str, os.PathLike)):
        return None
    folder = os.fspath(critic_model)
    _recover(os.path.normpath(folder))  # a save_critic killed between its renames: its earlier critic is beside
    if os.path.isdir(folder) and not os.listdir(folder) or (
            not os.path.exists(folder) and os.path.isdir(os.path.normpath(folder) + _PARTIAL)):
        raise ValueError(f"critic_model={folder!r} holds no critic and no model: "
                         + ("an empty folder" if os.path.isdir(folder) else "a save_critic to it was interrupted "
                            "before it completed") + ". Save the critic there "
                         "(trainer.model.save_critic(folder, trainer.processing_class)), or pass the id or path of a "
                         "critic or model.")
    if not os.path.isfile(os.path.join(folder, CRITIC_INFO_FILE)):
        folder = _pushed_critic(folder, init_kwargs) if not os.path.exists(folder) else None
        if folder is None:
            return None
    info = _read_info(folder)
    if info.get("critic") != critic:
        raise ValueError(f"critic_model={os.fspath(critic_model)!r} holds a critic={info.get('critic')!r} critic, but "
                         f"this run has critic={critic!r}: set PPOConfig(critic={info.get('critic')!r}) to continue "
                         "from it.")
    recorded = info.get("files")
    # A fully fine-tuned critic is rebuilt from its own config and weights; a critic saved before the file list was
    # recorded shows it by its config.json.
    full = ("config.json" in recorded if isinstance(recorded, list)
            else os.path.isfile(os.path.join(folder, "config.json")))
    # What this load reads (the adapter copy in critic/, the card and the tokenizer files are for other tools).
    reads = [CRITIC_STATE_FILE, *(["config.json"] if full else [])]
    if full and isinstance(recorded, list):
        reads += [name for name in recorded if fnmatch.fnmatch(name, "model*.safetensors*")]
    _check_saved_files(folder, reads)
    state = load_file(os.path.join(folder, CRITIC_STATE_FILE))
    if critic != "separate":  # the shared head and reward_lora are rebuilt on the policy / the reward model
        return SavedCritic(critic, state, None)
    base = info.get("base")
    if not full and isinstance(base, str) and _is_local_path(base) and not os.path.isdir(os.path.expanduser(base)):
        raise ValueError(f"The saved LoRA critic in {folder} is an adapter on the base {base!r}, a local folder that "
                         "is gone (moved or deleted since the critic was saved), so it cannot be loaded. Put the base "
                         "back at that path, or start a new critic from a base that is there: "
                         "critic_model=<its Hub id or path>.")
    return SavedCritic(critic, state, folder if full else base)


def _is_local_path(name: str) -> bool:
    """Whether a saved critic's `base` names a local folder (absolute, or relative with ./ ../ ~), never a Hub id."""
    return os.path.isabs(name) or name.startswith(("./", "../", "~", ".\\", "..\\"))


_DAMAGED_FIX = ("It was damaged (a copy or download cut short, or a file edited or removed since). Save the critic "
                "again from the run that trained it (trainer.model.save_critic(folder, trainer.processing_class)), "
                "or pass another critic_model.")


def _read_info(folder: str) -> dict:
    """The critic's `hf_ppo_critic.json`; an unreadable one is an error naming it."""
    path = os.path.join(folder, CRITIC_INFO_FILE)
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"The saved critic's {path} is unreadable ({type(err).__name__}: {err}). "
                         + _DAMAGED_FIX) from err
    if not isinstance(info, dict):
        raise ValueError(f"The saved critic's {path} holds {type(info).__name__}, not a critic's description. "
                         + _DAMAGED_FIX)
    return info


def _check_saved_files(folder: str, names: list[str]) -> None:
    """Every file of a saved critic that a load reads is there and opens (`file_problem`): else an error naming each
    file, before anything is built from them."""
    problems = [f"{path} is {problem}" for path in (os.path.join(folder, name) for name in names)
                if (problem := file_problem(path)) is not None]
    if problems:
        raise ValueError(f"The saved critic in {folder} cannot be loaded: {'; '.join(problems)}. " + _DAMAGED_FIX)


def _pushed_critic(repo_id: str, init_kwargs: dict | None) -> str | None:
    """The local snapshot of the Hub repo `repo_id` when it holds a critic (its `hf_ppo_critic.json`), else None: any
    other repo, or an id the Hub (or, offline, the cache) does not know, is an ordinary critic source, whose loading
    reports what is wrong with it."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kwargs = {k: v for k, v in (init_kwargs or {}).items() if k in ("revision", "token", "cache_dir")}
    try:
        hf_hub_download(repo_id, CRITIC_INFO_FILE, **kwargs)
    except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError) as err:
        answer = err.__cause__ if isinstance(err, LocalEntryNotFoundError) else err  # the Hub's, if it answered
        if not isinstance(answer, HfHubHTTPError) or isinstance(
                answer, (RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)):
            # No such file, repo or revision; not an id; or offline / unreachable with nothing cached (a critic
            # loaded before would be): an ordinary source, whose loading says what is wrong with it.
            return None
        # Any other answer (a server error, a refused token): guessing "not a critic" could load a pushed critic as
        # a plain model.
        status = answer.response.status_code if answer.response is not None else type(answer).__name__
        raise OSError(f"Could not tell whether critic_model={repo_id!r} is a critic pushed with push_critic_to_hub: "
                      f"the Hub answered {status}. Retry; check the token (critic_model_init_kwargs={{'token': ...}} "
                      "or `hf auth login`); or pass a local folder save_critic wrote.") from err
    return snapshot_download(repo_id, **kwargs)


# ---- the critic (PPOConfig.critic; docs/concepts/critics.md) ----------------------------------------------------
# LoRA of a 'reward_lora' critic when the policy is fully fine-tuned (no peft_config).
DEFAULT_CRITIC_LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def critic_lora_config(peft_config):
    """The critic's LoRA config: the policy's LoRA settings (a copy) on a base model, with no task head; without a
    policy peft_config, `DEFAULT_CRITIC_LORA`."""
    from peft import LoraConfig

    if peft_config is None:
        return LoraConfig(**DEFAULT_CRITIC_LORA)
    config = copy.deepcopy(peft_config)
    config.task_type = None  # the critic's body is a base model: no causal-LM head, no generation
    config.base_model_name_or_path = None  # set by peft to the critic's own base
    config.modules_to_save = None  # the value head is the critic's only trained non-LoRA part
    if isinstance(config.target_modules, (set, list, tuple)):
        # Names peft resolved on the policy ('model.layers.0.self_attn.q_proj') as layer names, for any backbone.
        config.target_modules = {name.rsplit(".", 1)[-1] for name in config.target_modules}
    return config


def dequantized_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight in full precision (fp32), dequantized when bitsandbytes quantized it."""
    weight = linear.weight
    if getattr(weight, "quant_state", None) is not None:  # bitsandbytes 4-bit
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if getattr(weight, "SCB", None) is not None:  # bitsandbytes 8-bit: int8 rows with one scale each
        return weight.data.float() * weight.SCB.float().unsqueeze(1) / 127
    return weight.detach().float()


def _backbone_and_score(model: nn.Module, role: str, fix: str) -> tuple[nn.Module, torch.Tensor | None, int]:
    """The causal backbone of a decoder sequence classifier or causal LM, for a one-label reward model its score
    weight (1, width) to start the value head from (None: the head starts at zero), and the width of the backbone's
    last hidden state: what the score head (or the LM head) reads, not always hidden_size (OPT-350m projects)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"The {role} must be a transformers model (or a Hub id / path); got {type(model).__name__}. "
                        f"{fix}")
    backbone = getattr(model, model.base_model_prefix, None)
    score = getattr(model, "score", None)
    decoder_classifier = isinstance(score, nn.Module) and not pools_itself(model)
    causal_lm = model.get_output_embeddings() is not None and not model.config.is_encoder_decoder
    if not isinstance(backbone, PreTrainedModel) or not (decoder_classifier or causal_lm):
        raise ValueError(f"The {role} ({type(model).__name__}) is not a decoder sequence classifier or causal LM: a "
                         "critic needs a causal backbone (an encoder's value at a token would see the tokens after "
                         f"it). {fix}")
    head = dequantized_weight(score) if decoder_classifier and score.weight.shape[0] == 1 else None
    reader = score if decoder_classifier else model.get_output_embeddings()
    return backbone, head, reader.in_features


CRITIC_VOCAB_FIX = ("The critic reads the policy's token ids, so it needs the policy's vocabulary: pass critic_model=<a "
                    "checkpoint with the policy's tokenizer, e.g. the policy's own id or path>, or use "
                    "critic='shared'.")


def _critic_tokenizer(source, given: PreTrainedTokenizerBase | None, init_kwargs: dict | None):
    """The tokenizer that belongs to the critic's source: `given`, else loaded from the id/path or from a model
    object's name_or_path; None when none can be found."""
    if given is not None:
        return given
    if isinstance(source, str):
        try:
            return load_tokenizer(source, "critic", init_kwargs)
        except (OSError, ValueError):
            return None
    return load_reward_tokenizer(source)[0]


def _reads_policy_ids(tokenizer, critic_tokenizer) -> bool:
    """Every token of the critic's tokenizer has the policy's id, and the policy's only other tokens are special tokens
    added to it (a [PAD] the user added in a spare row): then every id means the same to both."""
    policy, critic = tokenizer.get_vocab(), critic_tokenizer.get_vocab()
    if any(policy.get(token) != i for token, i in critic.items()):
        return False
    return set(policy) - set(critic) <= set(tokenizer.all_special_tokens)


def _check_critic_vocab(tokenizer, critic_tokenizer, source, role: str, fix: str) -> None:
    """The critic must read the policy's ids as they are: its tokenizer must give them the policy's meaning (or, when
    it has no findable tokenizer, it must come from the policy tokenizer's own checkpoint). (`check_vocab` then checks
    that its embedding has a row for each id.)"""
    if critic_tokenizer is not None:
        if _reads_policy_ids(tokenizer, critic_tokenizer):
            return
        why = "its tokenizer's vocabulary differs from the policy's"
    elif isinstance(source, PreTrainedModel) and same_checkpoint(source, tokenizer):
        return
    elif isinstance(source, str) and source == getattr(tokenizer, "name_or_path", None):
        return
    else:
        why = "its tokenizer could not be found, so nothing shows it reads the policy's token ids"
    raise ValueError(f"The critic would start from the {role}, but {why}. {fix}")


def critic_reward(kind: str, reward_model, reward, reward_processing_class, critic_model) -> tuple:
    """(source, loaded model, tokenizer) of the reward model a critic starts from or sits on. With mixed rewards
    (a list) that is the list's one reward model; several (or none) leave the choice to the user, by error."""
    if not isinstance(reward, list) or kind == "shared" or (kind == "separate" and critic_model is not None):
        return reward_model, reward, reward_processing_class
    models = [i for i, r in enumerate(reward) if isinstance(r, nn.Module)]
    if len(models) != 1:
        raise ValueError(f"critic={kind!r} starts from the reward model, but the reward_model list holds "
                         f"{len(models)} models. Use critic='separate' with critic_model=<id / path / model>, or "
                         "critic='shared'.")
    i = models[0]
    return reward_model[i], reward[i], reward_processing_class[i]


@dataclass(frozen=True)
class CriticLoading:
    """What `load_critic` reads of the run's settings (`PPOConfig.critic_loading` builds it): the fields of the same
    names, documented there, and the compute dtype and device the critic loads in."""

    critic: str = "shared"  # 'shared', 'separate' or 'reward_lora'
    critic_model_init_kwargs: dict | None = None  # from_pretrained keywords for a critic_model given by id/path
    critic_quantization: str = "none"  # '4bit', '8bit' or 'none' ('separate' from an id/path, with LoRA)
    reward_model_init_kwargs: dict | None = None  # used instead when the critic starts from the reward model's id/path
    gradient_checkpointing: bool = False  # a quantized critic base is prepared for k-bit training with it
    dtype: torch.dtype = torch.float32  # the compute dtype of the run's bf16 / fp16
    device: torch.device | str = "cpu"


def load_critic(critic_model, reward_source, reward, reward_processing_class, tokenizer, policy, peft_config,
                loading: CriticLoading) -> tuple[ValueModel | None, Callable[[], ContextManager]]:
    """(the critic `loading.critic` asks for: None for 'shared' (the value head on the policy), else a `ValueModel`;
    the context the reward model scores in, as it was loaded: `RewardSet`'s `scoring_context`).

    'separate': its own copy of a causal backbone + value head. Started from `critic_model` (id / path / model
    object) when given, else from the reward model (the N+ paper's initialisation; its score head becomes the value
    head): loaded again by id/path, or deep-copied when given as an unquantized object. A reward function has no
    model to start from: then `critic_model` is required. LoRA (the policy's LoRA settings, its own adapter) when
    the trainer got a peft_config, else full fine-tuning; `critic_quantization` ('4bit'/'8bit' need LoRA) and
    `critic_model_init_kwargs` (default: the reward model's) apply to an id/path. The reward scores as it is.
    'reward_lora': a LoRA adapter + value head on the reward model's already-loaded frozen base (no second base in
    memory); the head starts as the reward's score head, and the reward must score with the adapter disabled: the
    context returned disables it.
    The critic reads the policy's token ids, so a critic source with another vocabulary is an error here.
    """
    kind, dtype, device = loading.critic, loading.dtype, loading.device
    if kind == "shared":
        if critic_model is not None:
            raise ValueError("critic_model is given but PPOConfig.critic='shared' (the value head on the policy): set "
                             "critic='separate' to train a critic started from critic_model, or drop critic_model.")
        return None, contextlib.nullcontext
    from peft import get_peft_model, prepare_model_for_kbit_training

    if kind == "reward_lora":
        fix = "Use critic='separate' (with critic_model=<id/path>) or critic='shared'."
        if critic_model is not None:
            raise ValueError("critic_model applies to critic='separate'; critic='reward_lora' puts its adapter on the "
                             "reward model itself. Drop critic_model, or set critic='separate'.")
        if not isinstance(reward, PreTrainedModel):
            raise ValueError("critic='reward_lora' puts the critic on the reward model's base, but the reward is a "
                             f"function. {fix}")
        backbone, head, width = _backbone_and_score(reward, "reward model", fix)
        _check_critic_vocab(tokenizer, _critic_tokenizer(reward, reward_processing_class, None), reward,
                            "reward model", "critic='reward_lora' needs a reward model with the policy's tokenizer. "
                            + fix)
        check_vocab(reward, tokenizer, "reward model (the critic's base)", fix)
        # No prepare_model_for_kbit_training: it would recast the reward model's norms and change its scores.
        backbone = get_peft_model(backbone, critic_lora_config(peft_config), adapter_name="critic")
        critic = ValueModel(backbone, head, quantization_method=getattr(reward, "quantization_method", None),
                            width=width, kind="reward_lora", source=_source_name(reward_source))
        return critic, backbone.disable_adapter

    # critic == "separate"
    init_kwargs, quantization = loading.critic_model_init_kwargs, loading.critic_quantization
    source, given_tokenizer = critic_model, None
    if critic_model is None:
        if not isinstance(reward, nn.Module):
            raise ValueError(
                "critic='separate' starts the critic from the reward model, but the reward is a function. Pass "
                "critic_model=<id / path / model to start the critic from; the policy's own checkpoint works>, or "
                "use critic='shared'.")
        source, given_tokenizer = (reward_source if isinstance(reward_source, str) else reward), reward_processing_class
        if isinstance(source, str) and init_kwargs is None:
            init_kwargs = loading.reward_model_init_kwargs
    if quantization != "none" and peft_config is None:
        raise ValueError(f"critic_quantization={quantization!r} needs LoRA (a quantized base trains only "
                         "adapters): pass peft_config=LoraConfig(...), or set critic_quantization='none'.")
    if isinstance(source, str):
        model = from_pretrained(AutoModelForSequenceClassification, source, "critic model",
                                **_init_kwargs(init_kwargs, quantization, dtype, device))
        if not _is_quantized(model):  # a quantized one is loaded onto `device`; Trainer may not move the critic
            model = model.to(device)
    else:
        where = "critic_model" if critic_model is not None else "the reward model"
        if quantization != "none" or _is_quantized(source):
            raise ValueError(f"{where} is a model object: a critic can be quantized only when loaded by id/path (a "
                             "quantized object cannot be copied). Pass critic_model=<its Hub id or path> with "
                             "critic_quantization, or an unquantized object with critic_quantization='none'.")
        shared = critic_model is None or _shares_parameters(source, policy) or _shares_parameters(source, reward)
        model = (copy.deepcopy(source) if shared else source).to(device)
    _check_critic_vocab(tokenizer, _critic_tokenizer(source, given_tokenizer, init_kwargs), source,
                        "critic model" if critic_model is not None else "reward model", CRITIC_VOCAB_FIX)
    check_vocab(model, tokenizer, "critic model", CRITIC_VOCAB_FIX)
    backbone, head, width = _backbone_and_score(model, "critic model", CRITIC_VOCAB_FIX)
    if peft_config is not None:
        if _is_quantized(model):
            backbone = prepare_model_for_kbit_training(backbone,
                                                       use_gradient_checkpointing=loading.gradient_checkpointing)
        backbone = get_peft_model(backbone, critic_lora_config(peft_config), adapter_name="critic")
    else:
        backbone.requires_grad_(True)  # full fine-tuning (a copy of the frozen reward model starts frozen)
    critic = ValueModel(backbone, head, quantization_method=getattr(model, "quantization_method", None), width=width,
                        source=_source_name(source))
    return critic, contextlib.nullcontext


def _source_name(source) -> str | None:
    """The id or path a critic's base came from (what `save_critic` records), None for a model object. A local
    folder is recorded by its absolute path, as a saved policy's base is (`hub.publish.make_base_path_absolute`): a
    relative one would resolve against wherever the critic is loaded from, or name a Hub repo of the same name."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    name = os.fspath(source)
    return os.path.abspath(name) if not os.path.isabs(name) and os.path.isdir(name) else name


class ValueModel(GradientCheckpointingNames, nn.Module):
    """A critic with a body of its own: a transformers base model (the backbone of a sequence classifier or causal
    LM, or a `PeftModel` with a LoRA adapter around it) and an fp32 `hidden -> 1` value head on its last hidden state.

    `forward(input_ids, attention_mask, position_ids, logits_to_keep) -> values (batch, kept) fp32`: a value at every
    position, the last `logits_to_keep` kept (0 = all), as `AutoModelForCausalLMWithValueHead` gives `value`. The
    backbone must be causal (a decoder), so the value of a position sees no later token. `head` initialises the
    value head (a reward model's `score` weight, (1, hidden)); without it the head starts at zero. `kind` and `source`
    ('separate' / 'reward_lora', the base's id or path) are what `save_critic` records. What checkpoints
    store is every trainable tensor (`trainable_state_dict`): the LoRA adapter + head, or everything when the whole
    critic is fine-tuned.
    """

    def __init__(self, backbone: nn.Module, head: torch.Tensor | None = None, quantization_method=None,
                 width: int | None = None, kind: str = "separate", source: str | None = None):
        super().__init__()
        self.backbone = backbone
        # Which `PPOConfig.critic` it is, and the id/path its base was loaded from (None: an object): what
        # `save_critic` records, so a later run rebuilds it before loading the saved state.
        self.kind, self.source = kind, source
        if width is None:  # the width of the backbone's last hidden state (OPT-350m projects it below hidden_size)
            config = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
            width = head.shape[-1] if head is not None else config.hidden_size
        parameter = next(backbone.parameters())
        self.head = nn.Linear(width, 1, dtype=torch.float32, device=parameter.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if head is not None:
            with torch.no_grad():
                self.head.weight.copy_(head.reshape(1, -1).to(torch.float32))
        # Trainer never `.to()`-moves a bitsandbytes model (see PolicyAndCritic.quantization_method).
        self.quantization_method = quantization_method

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Values (batch, kept) fp32 for input_ids / attention_mask / position_ids (batch, seq)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.head(hidden.to(torch.float32)).squeeze(-1)

    def disable_adapter(self):
        """Context in which the backbone runs without its LoRA adapter (a no-op without one)."""
        if hasattr(self.backbone, "disable_adapter"):
            return self.backbone.disable_adapter()
        return contextlib.nullcontext()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor by name (CPU): what a checkpoint stores of this critic."""
        return {name: p.detach().cpu().contiguous() for name, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load what `trainable_state_dict` gave, exactly; other or missing names are an error naming them."""
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(f"The saved critic does not fit this critic: missing {missing[:3]} ({len(missing)}), "
                             f"unexpected {unexpected[:3]} ({len(unexpected)}). Resume with the checkpoint's `critic` "
                             "setting, critic model and LoRA config.")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name].to(device=p.device, dtype=p.dtype))

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs):
        """Checkpoint the backbone's activations; a frozen embedding (LoRA) is made to pass gradients, as
        checkpointed layers need an input that requires grad."""
        base = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        checkpointing_enable(base, activation_checkpointing_kwargs, **kwargs)
        if not base.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()

    def activation_checkpointing_disable(self):
        base = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        checkpointing_disable(base)
