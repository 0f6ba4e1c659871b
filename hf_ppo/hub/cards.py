"""The model cards: the policy's (rendered from `templates/policy_card.md.jinja`: what the training was, the models
and data it used, its hyperparameters and final metrics, and how to load it) and a pushed critic's. Local paths and
secrets never reach a card."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path

from ..evaluation.report import final_evaluation
from ..models import gguf
from ..models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE
from ..rollout.engines import SAMPLING_FIELDS, SamplingSettings
from ..runtime.warn import warn_user
from .plots import DEFAULT_PANELS, PLOT_STAMP, metric_series, plot_training_curves, x_axis

logger = logging.getLogger(__name__)


CARD_TEMPLATE = "policy_card.md.jinja"
PLOT_FILE = "training_curves.png"
CARD_TAGS = ["hf_ppo", "ppo", "rlhf"]
# (log-history key, label) of the metrics the card reports; the first one defines "best".
CARD_METRICS = [
    ("objective/scores", "reward (score)"),  # a reward model's, a function's or the weighted sum of several
    ("objective/kl", "KL to the reference"),
    ("rollout/response_length", "response length (tokens)"),
]
# LoRA fields worth showing, in this order; the rest of a PeftConfig dict is noise or a local path.
LORA_FIELDS = ["r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora",
               "modules_to_save", "task_type"]
FRAMEWORKS = ["torch", "transformers", "peft", "trl", "huggingface_hub", "hf_ppo"]

# A Hub repo id: "name" or "namespace/name" (letters, digits, "-", "_", "."; no "..", no leading separator).
_HUB_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_SECRET_KEY = re.compile(r"token|secret|password|api_key|credential", re.IGNORECASE)


# ---- What the trainer publishes --------------------------------------------------------------------------------------
CARD_HYPERPARAMETERS = [
    "learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_mini_batches", "num_ppo_epochs", *SAMPLING_FIELDS, "kl_coef",
    "kl_estimator", "adaptive_kl", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef", "entropy_coef",
    "whiten_rewards", "missing_eos_penalty", "normalize_rewards", "policy_quantization", "ref_quantization",
    "reward_quantization", "seed", "loss_aggregation", "cliprange_low", "cliprange_high", "dual_clip",
    "advantage_estimator", "num_generations", "scale_rewards", "critic", "critic_warmup_steps", "critic_learning_rate",
    "critic_updates_per_step", "lam_critic", "lam_length_alpha", "critic_hub_model_id", "importance_sampling_level",
    "use_kl_loss", "use_bias_correction_kl", "drop_uniform_groups", "max_refill_rounds",
    "reward_weights", "normalize_each_reward", "overlong_buffer_length"]
# How the card names each critic and each critic-free estimator.
_CRITIC_TEXT = {"shared": "a value head on the policy's body", "separate": "a separate critic model",
                "reward_lora": "a LoRA critic on the reward model's frozen base"}
_ESTIMATOR_TEXT = {"rloo": "RLOO (leave-one-out baseline)", "grpo": "GRPO (group-normalised)",
                   "dr_grpo": "Dr. GRPO (group mean-centred)", "reinforce_pp": "REINFORCE++"}


def method_texts(hyperparameters: dict) -> tuple[str, str]:
    """(what the training was, what one iteration does after scoring) for the card, from the advantage estimator,
    `num_generations` and the critic: a card never says "GAE with a value head" about a critic-free run."""
    estimator = hyperparameters.get("advantage_estimator", "gae")
    if estimator == "gae":
        critic = _CRITIC_TEXT.get(hyperparameters.get("critic", "shared"), "a critic")
        return (f"clipped PPO with {critic} and a KL penalty towards a frozen reference",
                "subtracts a per-token KL penalty towards the reference, estimates advantages with GAE on the "
                "critic's values, and takes several clipped policy and value updates on the batch")
    if estimator == "auto":
        critic = _CRITIC_TEXT.get(hyperparameters.get("critic", "shared"), "a critic")
        k = hyperparameters.get("num_generations", 2)
        return (f"clipped PPO with {critic} and a KL penalty towards a frozen reference, each batch's advantages "
                f"from GAE where the critic explained the returns and from the group baseline over {k} responses "
                "per prompt where it did not (EVPO)",
                "subtracts a per-token KL penalty towards the reference, estimates advantages with GAE on the "
                f"critic's values when their explained variance is above {hyperparameters.get('auto_ev_threshold', 0)}"
                f" or else against the mean of the {k} responses to each prompt, and takes several clipped policy "
                "and value updates on the batch")
    if estimator == "grpo" and hyperparameters.get("scale_rewards") in (False, "none"):
        estimator = "dr_grpo"
    name, k = _ESTIMATOR_TEXT.get(estimator, estimator), hyperparameters.get("num_generations", 1)
    kl = ("adds a KL term towards the reference to the loss" if estimator in ("grpo", "dr_grpo")
          else "subtracts a KL penalty towards the reference from the reward")
    return (f"clipped policy-gradient updates with {name} advantages over {k} responses per prompt (no critic) "
            "and a KL penalty towards a frozen reference",
            f"compares the {k} responses to each prompt ({name} advantages, no critic), {kl}, and takes several "
            "clipped policy updates on the batch")


@dataclass(frozen=True)
class PublishSettings:
    """What the card and the run record say of the run's settings (`PPOConfig.publish_settings` builds it): the
    card's table of `hyperparameters` (`CARD_HYPERPARAMETERS`, the per-device rollout batch and the world size), the
    policy's `model_init_kwargs` (a GGUF file among them), `hub_base_model_id` (the base a pushed adapter names), the
    compute `precision` ('bf16', 'fp16' or 'fp32'), and how the prompts were made and answered, so that an evaluation
    can prompt, sample and score as training did: `system_prompt`, `prompt_column`, `apply_chat_template_to_text`,
    `max_prompt_length`, the sampling settings (`sampling`, the run's `SamplingSettings` whole), the stop tokens
    (`stop_token`, and `stop_token_ids` with PPOConfig's `stop_token_id` folded in) and `reward_input_format`."""

    hyperparameters: dict
    model_init_kwargs: dict | None = None
    hub_base_model_id: str | None = None
    precision: str = "fp32"
    system_prompt: str | None = None
    prompt_column: str | None = None
    apply_chat_template_to_text: bool | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    max_prompt_length: int | None = 512
    stop_token: str | None = "eos"
    stop_token_ids: tuple[int, ...] | None = None
    reward_input_format: str = "auto"


def model_sources(model, reward_model, ref_model, policy_model, trained_adapter: str | None,
                  ref_adapter: str | None, fresh_adapter: bool) -> dict[str, str | None]:
    """How the card names the base, reward and reference models (ids as given; objects by `source_name`; a list of
    rewards as a list of names).

    An adapter given by id/path is named by its base, and is itself the reference; a reference adapter of a
    `PeftModel` object is named as such (never "the adapter disabled").
    """
    sources = {"model": _given_name(model),
               "reward_model": ([_given_name(r) for r in reward_model] if isinstance(reward_model, (list, tuple))
                                else _given_name(reward_model)),
               "ref_model": _given_name(ref_model)}
    if isinstance(model, str) and trained_adapter and not fresh_adapter:
        sources["model"] = policy_model.peft_config[trained_adapter].base_model_name_or_path
        sources["ref_model"] = sources["ref_model"] or model
    elif ref_adapter is not None:
        sources["ref_model"] = f"adapter {ref_adapter!r} of the policy"
    return sources


REWARD_FUNCTION = "reward function "  # how `source_name` names a callable reward (the space keeps it from a Hub id)


def _given_name(model) -> str | None:
    """A model's name as given: the id/path itself, else `source_name`."""
    return model if isinstance(model, str) else source_name(model)


def source_name(obj) -> str | None:
    """How the card names a model given as an object: its config's `_name_or_path`, else its class name; a reward
    function as `REWARD_FUNCTION` + its name (never mistaken for a Hub id)."""
    from torch import nn

    if obj is None:
        return None
    if callable(obj) and not isinstance(obj, nn.Module):
        return REWARD_FUNCTION + str(getattr(obj, "__name__", type(obj).__name__))
    model = getattr(obj, "pretrained_model", obj)  # a value-head wrapper names its body
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or type(obj).__name__


def write_policy_card(folder, peft_config: dict | None, sources: dict, settings: PublishSettings,
                      log_history: list[dict], *, repo_id: str, merged: bool, dataset_names: list[str],
                      saved_locally: bool = False, chat_prompts: bool = False) -> bool:
    """Render the trained policy's card (and plot) into `folder`; return whether the policy is an adapter.

    `peft_config`: the trained adapter's LoRA config as a dict (None: full weights); `sources`: {"model",
    "reward_model", "ref_model"} names as given to the trainer; `chat_prompts`: the run's prompts were chat messages
    (the card's example then prompts through the chat template). The base is named by `settings.hub_base_model_id`
    when set, and by the GGUF file it was converted from when it was one.
    """
    init_kwargs = settings.model_init_kwargs if isinstance(settings.model_init_kwargs, dict) else None
    gguf_file = gguf_origin(sources["model"], init_kwargs)
    write_model_card(folder, repo_id=repo_id, base_model=settings.hub_base_model_id or sources["model"],
                     reward_model=sources["reward_model"],
                     ref_model=sources["ref_model"], dataset_names=dataset_names, peft_config=peft_config,
                     hyperparameters=settings.hyperparameters, log_history=log_history,
                     merged=merged or (saved_locally and peft_config is None), saved_locally=saved_locally,
                     chat_prompts=chat_prompts, gguf_file=gguf_file,
                     gguf_repo=_hub_id(sources["model"]) if gguf_file else None, system_prompt=settings.system_prompt)
    return peft_config is not None


# hf_ppo's GGUF conversion folders: `<the file's stem>-<16 hex>` in `gguf.cache_root()` (models/gguf.py).
_GGUF_FOLDER = re.compile(r"(?P<stem>.+)-[0-9a-f]{16}")


def gguf_origin(model: str | None, init_kwargs: dict | None) -> str | None:
    """The name of the GGUF file the policy's base came from, or None: `gguf_file` in `init_kwargs`, a `.gguf` file
    given as the model, or hf_ppo's conversion folder of one (a base read back from an adapter trained on it)."""
    if (init_kwargs or {}).get("gguf_file"):
        return Path(init_kwargs["gguf_file"]).name
    if not isinstance(model, str):
        return None
    if model.lower().endswith(".gguf"):
        return Path(model).name
    folder = Path(model).expanduser()
    match = _GGUF_FOLDER.fullmatch(folder.name)
    try:
        in_cache = match is not None and folder.parent.resolve() == gguf.cache_root().resolve()
    except OSError:
        in_cache = False
    return f"{match['stem']}.gguf" if in_cache else None


# ---- Model card ------------------------------------------------------------------------------------------------------
def write_model_card(
    folder,
    *,
    repo_id: str,
    base_model: str | None,
    reward_model: str | list[str] | None,
    ref_model: str | None,
    dataset_names: list[str],
    peft_config: dict | None,
    hyperparameters: dict,
    log_history: list[dict],
    merged: bool = False,
    saved_locally: bool = False,
    chat_prompts: bool = False,
    gguf_file: str | None = None,
    gguf_repo: str | None = None,
    system_prompt: str | None = None,
) -> Path:
    """Render the policy's model card into `folder/README.md` and its plot into `folder/training_curves.png`.

    The card (template `hub/templates/policy_card.md.jinja`) names the base, reward and reference models and the
    datasets, lists LoRA and PPO hyperparameters, the final and best-reward metrics from `log_history` (reward =
    `objective/scores`, KL = `objective/kl`, length = `rollout/response_length`), how to load the policy, framework
    versions and citations. Its YAML metadata holds `base_model`, `library_name` (`peft`, or `transformers` when
    `merged`), `tags` and `datasets`. Nothing local is written: model and dataset names that are not Hub ids
    become "a local model"/"a local dataset", and hyperparameters holding a path or a secret are left out.
    `saved_locally`: the card of a folder written by `save_model()` (not pushed yet); its "How to load" loads the
    folder itself, `merged` then meaning a standalone model (no adapter). `chat_prompts`: the policy was trained on
    chat prompts, so the example prompts it through the tokenizer's chat template (plain text would be a prompt it
    never saw). `gguf_file`: the name of the GGUF file the base was converted from, `gguf_repo` the Hub repo
    holding it (None: a local file); the card names them instead of "a local model", and its example loads the base
    with `gguf_file` when `base_model` is that repo (a `base_model` of its own, the Hub id of the original model,
    loads as it is). `system_prompt`: the system message training put first in every prompt, which the example puts
    first too. The card names the rewards as what they were: reward models ("reinforcement learning from human
    feedback"), reward functions, or both. The plot has the four panels of `plots.DEFAULT_PANELS` against PPO
    iterations. Returns the path of README.md.
    """
    import jinja2
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "README.md"
    if path.exists() and not is_replaceable_card(path):
        warn_user(f"{path} is not a model card hf_ppo wrote, so it is kept as it is and no card (or plot) is written "
                  f"into {folder}. To get hf_ppo's card, save to another output_dir, or move that README.md away and "
                  "save again (the saved policy itself is complete without it).")
        return path
    plot_path = folder / PLOT_FILE
    plot = None
    # A plot is hf_ppo's when stamped, or (drawn before the stamp) when it sits beside hf_ppo's card.
    if plot_path.exists() and not is_hf_ppo_plot(plot_path) and not is_hf_ppo_card(path):
        warn_user(f"{plot_path} is not a plot hf_ppo drew, so it is kept as it is and the card shows no training "
                  f"curves. Move it away (or save to another output_dir) to get them.")
    else:
        plot = plot_training_curves(
            log_history,
            plot_path,
            panels=DEFAULT_PANELS,
            title=f"PPO training of {repo_id.split('/')[-1]}",
            x_key=x_axis(log_history),
        )
    base_id, ref_id = _hub_id(base_model), _hub_id(ref_model)
    rewards = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    reward_words = reward_texts(rewards)
    hub_datasets = [d for d in (_hub_id(name) for name in dataset_names) if d]
    card_data = ModelCardData(
        base_model=base_id,
        library_name="transformers" if merged else "peft",
        pipeline_tag="text-generation",
        tags=list(CARD_TAGS),
        datasets=hub_datasets or None,
        model_name=repo_id.split("/")[-1],
    )
    if ref_model is not None:
        reference_text = _model_text(ref_id, ref_model)
    elif peft_config is not None:
        reference_text = "the initial policy: the base model with the LoRA adapter disabled"
    else:
        reference_text = "the initial policy (a frozen copy of the base model)"
    metrics, last_step, best_step = _metric_rows(log_history)
    evaluation_step, evaluation = final_evaluation(log_history)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    content = env.from_string(_card_template()).render(
        card_data=card_data.to_yaml(),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        merged=merged,
        saved_locally=saved_locally,
        base_model_text=_base_text(base_id, base_model, gguf_file, gguf_repo),
        base_load_args=f'"{base_id or "<base model id>"}"' + (f', gguf_file="{gguf_file}"'
                                                                if gguf_file and base_id and base_id == gguf_repo
                                                                else ""),
        chat_prompts=chat_prompts,
        system_prompt_literal=json.dumps(system_prompt) if system_prompt else None,  # a Python string literal too
        **reward_words,
        max_new_tokens=hyperparameters.get("response_length") or 32,
        reward_model_text=", ".join(dict.fromkeys(_model_text(_hub_id(r), r) for r in rewards)),
        reference_text=reference_text,
        datasets_text=_datasets_text(dataset_names),
        metrics=metrics,
        last_step=last_step,
        best_step=best_step,
        evaluation=evaluation,
        evaluation_step=evaluation_step,
        plot_file=PLOT_FILE if plot is not None else None,
        lora=_lora_rows(peft_config),
        hyperparameters=_public_rows(hyperparameters),
        method_text=method_texts(hyperparameters)[0],
        procedure_text=method_texts(hyperparameters)[1],
        versions=[(name, _version(name)) for name in FRAMEWORKS],
    )
    ModelCard(content).save(path)  # parsing it here fails fast on broken YAML metadata
    return path


def reward_texts(rewards: list) -> dict[str, str]:
    """How the card names the run's rewards (`rewards`: their names as `model_sources` gives them): reward models
    (RLHF proper: "from human feedback"), reward functions (`REWARD_FUNCTION` names: no human feedback, no reward
    model), or both. Keys: the template's `reward_source_text`, `reward_label`, `reward_label_the`, `left_out_text`."""
    functions = [r for r in rewards if isinstance(r, str) and r.startswith(REWARD_FUNCTION)]
    if rewards and len(functions) == len(rewards):
        many = len(functions) > 1
        return {"reward_source_text": "with reward functions",
                "reward_label": "reward functions" if many else "reward function",
                "reward_label_the": "the reward functions" if many else "the reward function",
                "left_out_text": "The critic and the reference"}
    if functions:
        return {"reward_source_text": "from a reward model and reward functions", "reward_label": "rewards",
                "reward_label_the": "the rewards (weighted sum)",
                "left_out_text": "The critic, the reference and the reward model"}
    return {"reward_source_text": "from human feedback", "reward_label": "reward model",
            "reward_label_the": "the reward model", "left_out_text": "The critic, the reference and the reward model"}


def is_hf_ppo_card(path) -> bool:
    """Whether the README.md at `path` is a policy or critic card hf_ppo wrote (its metadata's `hf_ppo` tag)."""
    from huggingface_hub import metadata_load

    try:
        tags = (metadata_load(path) or {}).get("tags") or []
    except Exception:  # unreadable or malformed metadata: not a card hf_ppo wrote
        return False
    return isinstance(tags, list) and CARD_TAGS[0] in tags


# PEFT's blank card: what `save_pretrained` writes as README.md beside an adapter when there is none
# (`PeftModel.create_or_update_model_card`, the same from peft 0.19 to 0.21): huggingface_hub's model card template
# rendered with no metadata, these metadata fields filled in, and its own lines appended (a quantization config, its
# version). Nobody's own writing, so a card may replace it; anything else in the file makes it the user's.
_PEFT_CARD_FIELDS = {"base_model", "library_name", "pipeline_tag", "tags"}
_PEFT_CARD_TAIL = re.compile(
    r"(?:## Training procedure\n\nThe following `bitsandbytes` quantization config was used during training:\n"
    r"(?:- [^\n]*\n)*\n)?### Framework versions\n\n- PEFT \S+(?:\n- PEFT \S+)*")


def is_replaceable_card(path) -> bool:
    """Whether a card may be written over the README.md at `path`: hf_ppo's own card, or PEFT's untouched blank card
    (`is_peft_blank_card`); never a user's own README, an edited PEFT template included."""
    return is_hf_ppo_card(path) or is_peft_blank_card(path)


def is_peft_blank_card(path) -> bool:
    """Whether the README.md at `path` is, byte for byte, a blank card PEFT's `save_pretrained` writes: the body
    huggingface_hub's blank template (the installed one) followed by PEFT's appended lines, the metadata only the
    fields PEFT fills in (`library_name: peft`, its sorted tags, `pipeline_tag`, `base_model`), as PEFT writes them.
    One placeholder filled in, a line added or removed, a metadata field or comment of the user's: False. (A tag
    added in sorted order is not told from the base model's own tags, which PEFT writes too.)"""
    from huggingface_hub import ModelCard, ModelCardData

    try:
        text = Path(path).read_bytes().decode("utf-8")
        if not text.startswith("---\n"):  # PEFT's card opens with its metadata block
            return False
        card = ModelCard(text)
        data = card.data.to_dict()
        blank = ModelCard.from_template(ModelCardData())
    except Exception:  # unreadable, not UTF-8, malformed metadata: not PEFT's blank card
        return False
    tags = data.get("tags")
    if (set(data) - _PEFT_CARD_FIELDS or data.get("library_name") != "peft"
            or data.get("pipeline_tag") not in (None, "text-generation")
            or (tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
                                      or tags != sorted(set(tags))))):
        return False
    head = "\n".join(blank.text.splitlines()) + "\n"  # PEFT rejoins the template's lines, then appends its own
    if not card.text.startswith(head) or not _PEFT_CARD_TAIL.fullmatch(card.text[len(head):]):
        return False
    for key, value in data.items():  # the metadata block exactly as PEFT's `card.save` writes it (no comments)
        blank.data[key] = value
    blank.text = card.text
    return str(blank) == text


def is_hf_ppo_plot(path) -> bool:
    """Whether the PNG at `path` is a training plot hf_ppo drew (its `Software` text chunk, `plots.PLOT_STAMP`)."""
    try:
        from PIL import Image

        with Image.open(path) as image:
            return image.info.get("Software") == PLOT_STAMP
    except Exception:  # not a PNG it can read: not hf_ppo's
        return False


def _card_template() -> str:
    """The card template, `templates/policy_card.md.jinja` beside this module (package data in the wheel)."""
    return resources.files(__package__).joinpath("templates").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")


def _looks_local(value: str) -> bool:
    """True when `value` reads as a path on this machine (absolute, home-relative, or an existing file/folder)."""
    value = value.strip()
    if not value:
        return False
    if os.path.isabs(value) or value.startswith(("~", "./", "../", ".\\")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return True
    if str(Path.home()) in value:
        return True
    try:
        return os.sep in value and Path(value).exists()
    except OSError:
        return False


def _hub_id(value: str | None) -> str | None:
    """`value` when it is a Hub repo id and not a local folder; None otherwise (so no local path leaks)."""
    if not value:
        return None
    value = str(value)
    if _HUB_ID.match(value) and not _looks_local(value) and not Path(value).exists():
        return value
    return None


def _model_text(hub_id: str | None, given: str | None) -> str:
    if given and given.startswith(REWARD_FUNCTION):
        return f"a reward function (`{given[len(REWARD_FUNCTION):]}`)"
    if hub_id:
        return f"[{hub_id}](https://huggingface.co/{hub_id})"
    return "a local model" if given else "not recorded"


def _base_text(hub_id: str | None, given: str | None, gguf_file: str | None, gguf_repo: str | None) -> str:
    """The base model's cell: `_model_text`, and the GGUF file it was converted from (a file name, never a path)."""
    if not gguf_file:
        return _model_text(hub_id, given)
    origin = (f"the GGUF file `{gguf_file}` of [{gguf_repo}](https://huggingface.co/{gguf_repo})" if gguf_repo
              else f"the GGUF file `{gguf_file}` (a local file)")
    if hub_id and hub_id != gguf_repo:
        return f"[{hub_id}](https://huggingface.co/{hub_id}), trained from {origin}, de-quantized by hf_ppo"
    return f"{origin}, de-quantized by hf_ppo"


def _datasets_text(names: list[str]) -> str:
    shown = []
    for name in names:
        hub_id = _hub_id(name)
        shown.append(f"[{hub_id}](https://huggingface.co/datasets/{hub_id})" if hub_id else "a local dataset")
    return ", ".join(dict.fromkeys(shown)) or "not recorded"


def _contains_local(value) -> bool:
    if isinstance(value, str):
        return _looks_local(value)
    if isinstance(value, dict):
        return any(_contains_local(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_contains_local(v) for v in value)
    return False


def _format_value(value) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (set, frozenset)):
        text = ", ".join(sorted(map(str, value)))
    elif isinstance(value, (list, tuple)):
        text = ", ".join(map(str, value))
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    # A "|" would end the markdown table cell.
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _public_rows(values: dict | None) -> list[tuple[str, str]]:
    """(key, formatted value) rows safe to publish: secrets and anything naming a local path are dropped."""
    rows = []
    for key, value in (values or {}).items():
        if _SECRET_KEY.search(str(key)) or _contains_local(value):
            continue
        rows.append((str(key), _format_value(value)))
    return rows


def _lora_rows(peft_config: dict | None) -> list[tuple[str, str]]:
    if not peft_config:
        return []
    picked = {k: peft_config[k] for k in LORA_FIELDS if peft_config.get(k) is not None}
    return _public_rows(picked)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _metric_rows(log_history: list[dict]) -> tuple[list[dict], int | None, int | None]:
    """Rows (final, at the best-reward step, min, max) for each logged card metric; plus last and best step (None
    when the reward was never logged, or had one value at every logged step)."""
    series = {key: metric_series(log_history, key) for key, _ in CARD_METRICS}
    series = {key: s for key, s in series.items() if s[0]}
    if not series:
        return [], None, None
    last_step = max(steps[-1] for steps, _ in series.values())
    best_step = None
    reward_key = CARD_METRICS[0][0]
    if reward_key in series and min(series[reward_key][1]) != max(series[reward_key][1]):
        # A reward that never moved has no best step: "at best reward (step 2)" would name the first step it logged.
        steps, values = series[reward_key]
        best_step = steps[max(range(len(values)), key=values.__getitem__)]
    rows = []
    for key, label in CARD_METRICS:
        if key not in series:
            continue
        steps, values = series[key]
        at_best = dict(zip(steps, values)).get(best_step) if best_step is not None else None
        rows.append({"label": label, "final": _fmt(values[-1]), "at_best": _fmt(at_best),
                     "min": _fmt(min(values)), "max": _fmt(max(values))})
    return rows, last_step, best_step


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "source checkout" if package == "hf_ppo" else "not installed"


def write_critic_card(folder, repo_id: str, critic: str, base: str | None) -> Path:
    """The critic's README.md: an hf_ppo critic, which `critic` kind, its base model, how to load it."""
    from huggingface_hub import ModelCard, ModelCardData

    full = critic == "separate" and Path(folder, "config.json").is_file()
    lora = critic != "shared" and not full
    base_id = _hub_id(base)
    card_data = ModelCardData(base_model=base_id, library_name="peft" if lora else None,
                              tags=[*CARD_TAGS, "critic", "value-model"], model_name=repo_id.split("/")[-1])
    holds = {"shared": "a value head (`hidden -> 1`) that reads the hidden states of the policy it was trained beside",
             "separate": "a LoRA adapter (in `critic/`, PEFT's layout) + value head on its base" if lora else
             "a fully fine-tuned critic, also a one-label `AutoModelForSequenceClassification` (the value head is its "
             "score layer; the head's bias is only in `critic.safetensors`)",
             "reward_lora": "a LoRA adapter (in `critic/`, PEFT's layout) + value head on the reward model's base"}
    carries = {"shared": "The value head reads the policy's body: its values carry over only to the same policy "
                         "weights (the policy it was trained beside, its adapter included).",
               "separate": "It carries over to any policy with the same tokenizer.",
               "reward_lora": "Pass the same reward model: the adapter sits on it, and the reward scores with the "
                              "adapter disabled."}
    content = f"""---
{card_data.to_yaml()}
---

# {repo_id.split("/")[-1]}

The critic (value model) of a PPO run trained with hf_ppo: `critic="{critic}"`, {_CRITIC_TEXT[critic]}. It holds
{holds[critic]}. It is not a policy: it predicts a value per response token for GAE, and generates nothing.

- Base model: {_model_text(base_id, base)}
- Files: `{CRITIC_STATE_FILE}` (the critic's state, exactly as a checkpoint stores it) and `{CRITIC_INFO_FILE}` (which
  critic it is, and its base)

## How to load

Start a new run's critic from it, with the same `critic` setting:

```python
from hf_ppo import PPOConfig, PPOLMTrainer

args = PPOConfig(..., critic="{critic}")
trainer = PPOLMTrainer(model=..., args=args, reward_model=..., critic_model="{repo_id}")
```

hf_ppo rebuilds the critic as the saved run did and loads `{CRITIC_STATE_FILE}` into it: its values are bitwise the
pushed critic's. {carries[critic]}
"""
    path = Path(folder) / "README.md"
    ModelCard(content).save(path)  # parsing it here fails fast on broken YAML metadata
    return path
