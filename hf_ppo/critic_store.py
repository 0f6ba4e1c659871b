"""A critic that outlives the run: `save_critic` writes a trained critic to a folder, `saved_critic` reads one back
when it is passed as the trainer's `critic_model`, so a critic fitted in one run starts the next.

The folder holds `critic.safetensors` (exactly the critic state a checkpoint stores: the shared value head; a
critic's LoRA adapter + value head; or a fully fine-tuned critic's every weight) and `hf_ppo_critic.json` (which
`critic` it is and, for a LoRA critic, the id/path of the base it sits on). Beside them, in the formats other tools
read: a fully fine-tuned `"separate"` critic is also a one-label sequence-classification model (config.json +
weights; the value head is its score layer, whose bias, which a score layer lacks, is in critic.safetensors); a LoRA
critic is also a PEFT adapter folder (in the subfolder `critic/`, PEFT's layout for an adapter named "critic").
hf_ppo reloads from critic.safetensors, so the values are bitwise the saved critic's.
`push_critic_to_hub` (hub.py) pushes such a folder to a Hub repo of its own; `saved_critic` reads that repo back by id.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .modeling import PolicyAndCritic

CRITIC_STATE_FILE = "critic.safetensors"
CRITIC_INFO_FILE = "hf_ppo_critic.json"


def save_critic(model: nn.Module, folder: str, tokenizer=None) -> str:
    """Write the critic of `model` (an `AutoModelForCausalLMWithValueHead`: its shared value head, or a
    `PolicyAndCritic`: its `ValueModel`) to `folder`; return the folder. `folder` must be new, empty, or a critic
    saved before (which is replaced): a critic's config.json and weights would overwrite a model saved there. A
    fully fine-tuned critic is a model folder, which needs its tokenizer (the policy's: a critic reads the policy's
    token ids): pass `tokenizer`."""
    state = model.critic_state_dict()
    if not state:
        raise ValueError("This run has no critic to save (a critic-free advantage_estimator).")
    full = isinstance(model, PolicyAndCritic) and not hasattr(model.critic.backbone, "peft_config")
    if full and tokenizer is None:
        raise ValueError("A fully fine-tuned critic is saved as a model folder, with the tokenizer a later run checks "
                         "its vocabulary against: pass the policy's tokenizer, "
                         "trainer.model.save_critic(folder, trainer.processing_class).")
    if os.path.isdir(folder) and os.listdir(folder) and not os.path.isfile(os.path.join(folder, CRITIC_INFO_FILE)):
        raise ValueError(f"save_critic: {folder!r} already holds files that no save_critic wrote (a policy saved there "
                         "would be overwritten by the critic's config and weights). Give the critic a folder of its "
                         "own, e.g. os.path.join(output_dir, 'critic').")
    os.makedirs(folder, exist_ok=True)
    info = {"critic": "shared", "base": None}
    if isinstance(model, PolicyAndCritic):
        value_model = model.critic
        info = {"critic": value_model.kind, "base": value_model.source}
        if full:
            _save_sequence_classifier(value_model, folder)
            tokenizer.save_pretrained(folder)
        else:
            value_model.backbone.save_pretrained(folder)  # the adapter, in folder/critic/ (its adapter name)
    save_file(state, os.path.join(folder, CRITIC_STATE_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, CRITIC_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
    return folder


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
    if not os.path.isfile(os.path.join(folder, CRITIC_INFO_FILE)):
        folder = _pushed_critic(folder, init_kwargs) if not os.path.exists(folder) else None
        if folder is None:
            return None
    with open(os.path.join(folder, CRITIC_INFO_FILE)) as f:
        info = json.load(f)
    if info.get("critic") != critic:
        raise ValueError(f"critic_model={os.fspath(critic_model)!r} holds a critic={info.get('critic')!r} critic, but "
                         f"this run has critic={critic!r}: set PPOConfig(critic={info.get('critic')!r}) to continue "
                         "from it.")
    state = load_file(os.path.join(folder, CRITIC_STATE_FILE))
    if critic != "separate":  # the shared head and reward_lora are rebuilt on the policy / the reward model
        return SavedCritic(critic, state, None)
    full = os.path.isfile(os.path.join(folder, "config.json"))
    return SavedCritic(critic, state, folder if full else info.get("base"))


def _pushed_critic(repo_id: str, init_kwargs: dict | None) -> str | None:
    """The local snapshot of the Hub repo `repo_id` when it holds a critic (its `hf_ppo_critic.json`), else None: any
    other repo, or an id the Hub (or, offline, the cache) does not know, is an ordinary critic source, whose loading
    reports what is wrong with it."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

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
